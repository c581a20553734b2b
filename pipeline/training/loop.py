"""The driver's loop: a strategy submits rounds, the loop collects them, hooks write the outputs.

The single place that waits on the cluster: tasks never compute or wait. Rounds are submitted
one ahead of the one being collected (except before a checkpoint), so a round's tasks start as
soon as the previous one's state lands, and augmentation runs ``augment.prefetch`` rounds ahead
of training. What a round submits is the strategy's (``pipeline.training.strategies``); recovery is a
pure decision (``pipeline.training.recovery``); stage timing is ``pipeline.training.telemetry``; the files are
``pipeline.outputs.run_dir``.
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import augment as aug
from pipeline.averaging import exact as averaging
from pipeline.outputs import checkpoint
from pipeline.outputs import run_dir as outputs
from pipeline.training import recovery
from pipeline.outputs import resume as resuming
from pipeline.outputs import fs as rundir
from pipeline.training import strategies
from pipeline.outputs.checkpoint import HostState
from pipeline.outputs.metrics import line as metrics_line
from pipeline.core.config import Config
from pipeline.core.errors import (ClusterError, DivergenceError, Interrupted, ResumeError, UsageError,
                                  one_line)
from pipeline.backends.chainer.models import build_model, check_model_name
from pipeline.backends.chainer.state import set_state
from pipeline.training.strategies.base import Context
from pipeline.training.telemetry import StageClock


class TrainOutput(NamedTuple):
    history: list  # one metrics dict per round (the lines of metrics.jsonl)
    model: object  # chainer.Link with the final (averaged) weights, on the host
    params: dict  # the same weights as a state dict
    out: str | None
    config: Config
    status: str = "done"  # "done", or "complete" when a resumed run had nothing left to do


class _Pending(NamedTuple):
    rnd: object
    live: object  # the strategy's state after this round (futures)
    metrics: list  # futures of the updates' metric dicts
    evals: list  # futures of evaluate- results ([] when not evaluated)


def _log_default(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(config: Config, client=None, *, resume: bool = False, overwrite: bool = False,
          log: Callable[[str], None] | None = None, on_round: Callable[[dict], None] | None = None,
          stop=None, hooks=()) -> TrainOutput:
    """Train ``config`` on ``client`` (or on a LocalCluster/scheduler from ``config.cluster``).

    ``on_round`` is called with each round's metrics dict (live plots in notebooks). ``stop``
    (a :class:`pipeline.core.interrupt.StopRequest`) is read between rounds: once requested, the run
    finishes the rounds in flight, writes a checkpoint and raises
    :class:`pipeline.core.errors.Interrupted`. ``hooks`` are run-output hooks (:mod:`pipeline.outputs.hooks`)
    besides the ones the config asks for. The data, the device and a resumed checkpoint are
    checked before any cluster starts.
    """
    log = log or _log_default
    config = _normalise(config)
    out = outputs.prepare(config.out, resume, overwrite)
    found = resuming.load(out, config.to_dict(), log) if resume else None
    # CIFAR and synthetic data are checked here, before a cluster starts; image folders and
    # file lists are checked by scan- tasks on the cluster.
    dataset = _load_dataset(config) if _reads_on_driver(config) else None
    gpus = _check_device(config) if client is None else ()
    prep = _prepare(config, out, dataset, found) if dataset is not None else None
    if prep is not None and prep.complete:
        return _already_complete(config, out, prep, log)
    from pipeline.cluster.connection import Roles, connect
    with contextlib.ExitStack() as stack:
        if client is None:
            roles = Roles(config.augment.resource, config.train.cpu_resource)
            client = stack.enter_context(connect(config.cluster, log=log, gpus=gpus, roles=roles))
        if prep is None:
            prep = _prepare(config, out, _load_dataset(config, client), found)
            if prep.complete:
                return _already_complete(config, out, prep, log)
        # config.json says what was trained: the data's class count (100 for CIFAR-100)
        config = config.replace(**{"model.n_classes": prep.dataset.n_classes})
        files = strategies.get(config.train.strategy).files
        run = _Run(client, config, outputs.RunDir(out, config, log, files), log, on_round,
                   prep=prep, stop=stop, hooks=list(hooks) + _config_hooks(config, out))
        try:
            return run.run(resume, overwrite)
        except BaseException:
            if out is not None and rundir.restore(out):  # an overwrite with no checkpoint yet
                log(f"the new run failed before its first checkpoint; the run it was to replace "
                    f"is back in {out}")
            raise


class _Prepared(NamedTuple):
    """What a run knows before a cluster starts: data, plan and the state it starts from."""
    dataset: object  # pipeline.data.datasets.Dataset (lazy; validated on the driver)
    rounds: list  # the plan: pipeline.core.schedule.Round for every round of the run
    per_epoch: int
    period: int
    state: HostState | None  # the checkpoint a resume goes on from (None: from the start)

    @property
    def complete(self) -> bool:
        return self.state is not None and self.state.round >= len(self.rounds) - 1


def _reads_on_driver(config: Config) -> bool:
    """Whether the data source is checked on the driver (CIFAR, synthetic), not in scan- tasks."""
    from pipeline.data.datasets import READERS
    cfg = config.data
    reader = next((r for r in READERS if r.claims(cfg.source, cfg)), None)
    return reader is None or reader.name in ("synthetic", "cifar")


def _load_dataset(config: Config, client=None):
    from pipeline.data.datasets import load_dataset
    cfg = config.data
    return load_dataset(cfg.source, cfg, download=cfg.download, client=client)


def _check_device(config: Config) -> list:
    """GPU ids for an embedded cluster; refuses ``--device gpu`` where it cannot work before a
    cluster starts (with ``--scheduler`` the workers' resources decide, after connecting)."""
    from pipeline.cluster.connection import local_gpus, scheduler_address
    device = config.train.device
    if device == "cpu":
        return []
    gpus = local_gpus()
    if device == "gpu" and scheduler_address(config.cluster) is None:
        import importlib.util
        if not gpus:
            raise UsageError("--device gpu: this machine has no GPU for the local cluster "
                             "(nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is empty); use "
                             "--device cpu, or --scheduler ADDR of a cluster with GPU workers")
        if importlib.util.find_spec("cupy") is None:
            raise UsageError("--device gpu needs CuPy: pip install -e '.[gpu]' (or --device cpu)")
    return gpus


def _prepare(config: Config, out, dataset, found: "resuming.Resume | None") -> _Prepared:
    """The plan (the strategy's) and the state to start from; a resume keeps the finished
    rounds as the checkpoint's run planned them and plans on to ``train.epochs``."""
    strategy = strategies.get(config.train.strategy)
    n_train = int(dataset.train_images.shape[0])
    state, done = None, []
    if found is not None:
        state = found.state
        if state is not None:
            before = config.replace(**{"train.epochs": found.saved["train"]["epochs"]})
            done = strategy.plan(before, n_train)[0][:state.round + 1]
    rounds, per_epoch, period = strategy.plan(config, n_train, done)
    if state is not None:
        _check_resumed(config, out, state, dataset.n_classes)
    if state is not None and len(done) == len(rounds):
        trained = (done[-1].global_step + done[-1].steps) / per_epoch
        if trained > config.train.epochs + 1e-9:
            raise ResumeError(f"{out} has trained {trained:g} epochs already, more than "
                              f"--epochs {config.train.epochs:g}")
    return _Prepared(dataset, rounds, per_epoch, period, state)


def _already_complete(config: Config, out, prep: _Prepared, log) -> TrainOutput:
    """A resume with nothing left to run: say so and return the run's final state; no cluster."""
    epochs = config.train.epochs
    log(f"{out} is complete: {len(prep.rounds)} rounds, {epochs:g} epochs; to train it longer "
        f"give more epochs: --resume {out} --epochs {epochs * 2:g}")
    history = _read_metrics(out)
    params = {k: v for k, v in prep.state.params[0].items() if not k.startswith("opt/")}
    model = set_state(build_model(config.model.name, prep.dataset.n_classes), params)
    return TrainOutput(history, model, params, str(out), config, status="complete")


def _read_metrics(out) -> list:
    """The readable lines of ``OUT/metrics.jsonl`` (a torn or garbled line is skipped)."""
    path = Path(out) / "metrics.jsonl"
    return rundir.read_metrics(path, last_round=1 << 62) if path.exists() else []


def _check_resumed(config: Config, out, state: HostState, n_classes: int) -> None:
    """The checkpoint's arrays fit the model (names, shapes, dtypes) before anything is sent."""
    if len(state.params) < config.train.replicas or len(state.opts) != len(state.params):
        raise ResumeError(f"checkpoint of round {state.round} in {out} holds "
                          f"{len(state.params)} parameter set(s), the run has "
                          f"{config.train.replicas} replica(s)")
    template = _initial_params(config, n_classes)
    checkpoint.check_state(state, template, f"round {state.round} in {out}")


def _check_finite(state: HostState, rnd) -> None:
    """DivergenceError if the gathered state (after the average and the outer step, which no
    train task has seen yet) holds NaN or Inf: checked before it is saved or returned."""
    where = checkpoint.first_nonfinite(state)
    if where is not None:
        raise DivergenceError(f"training diverged in round {rnd.index} (epoch {rnd.epoch}): "
                              f"the averaged state's {where} is NaN or Inf (not saved; the last "
                              "good checkpoint stays the latest)")


def _config_hooks(config: Config, out) -> list:
    """The run-output hooks the config asks for, and the chance-level watch every run has."""
    from pipeline.outputs import hooks
    chosen = [hooks.ChanceWatch()]
    if out is not None and config.csv:
        chosen.append(hooks.CSVLog(Path(out) / "metrics.csv"))
    if out is not None and config.tensorboard:
        chosen.append(hooks.TensorBoardLog(Path(out) / "tensorboard"))
    return chosen


def _dataset_label(source: str) -> str:
    """A short name for the data in titles: the directory or archive name, or synthetic:N:M.

    >>> _dataset_label("/data/cifar-10-batches-py/"), _dataset_label("synthetic")
    ('cifar-10-batches-py', 'synthetic')
    """
    return Path(str(source).rstrip("/")).name or str(source)


def _normalise(config: Config) -> Config:
    config.validate()
    check_model_name(config.model.name)
    aug.get_policy(config.augment.policy)  # ValueError naming augment.policy
    strategy = strategies.get(config.train.strategy)
    strategy.check(config)
    return strategy.resolve(config)  # auto fields: the strategy's recipe (config.json shows them)


class _Run:
    """One training run on one client: set-up, the loop with its recovery, the outputs."""

    def __init__(self, client, config: Config, out: outputs.RunDir, log, on_round, *,
                 prep: _Prepared, stop=None, hooks=()):
        self.client, self.config, self.out, self.log, self.on_round = (
            client, config, out, log, on_round)
        self.prep, self.stop, self.hooks = prep, stop, list(hooks)
        self.history: list[dict] = []

    # ---- set-up --------------------------------------------------------------------------
    def _setup(self) -> None:
        from pipeline.cluster import connection as cluster
        from pipeline.training import graph
        cfg, t = self.config, self.config.train
        t0 = time.perf_counter()
        dataset = self.prep.dataset
        device, train_res = self._device()
        augment_res = ({cfg.augment.resource: 1}
                       if cluster.has_resource(self.client, cfg.augment.resource) else None)
        if device == "cpu" and train_res:
            self.log(f"train-/evaluate- tasks on the workers advertising {t.cpu_resource}, "
                     f"decode-/augment- on those advertising {cfg.augment.resource}"
                     if augment_res else f"train-/evaluate- tasks on the workers advertising "
                     f"{t.cpu_resource}")
        data = graph.persist_dataset(self.client, dataset, resources=augment_res)
        if data.note:
            self.log(data.note)
        self.initial = _initial_params(cfg, dataset.n_classes)
        from pipeline.cluster.watchdog import Watchdog
        self.watchdog = Watchdog(self.client, cfg.cluster, self.log)  # looks while we wait
        self.graph = graph.RoundGraph(self.client, data, cfg, n_classes=dataset.n_classes,
                                      device=device, train_resources=train_res,
                                      augment_resources=augment_res,
                                      payload_bytes=averaging.nbytes(self.initial),
                                      watchdog=self.watchdog)
        self.K = t.replicas
        self.ctx = Context(cfg, self.K, data.n_train, self.prep.per_epoch, dataset.n_classes,
                           device, tuple(self.prep.rounds))
        self.strategy_cls = strategies.get(t.strategy)
        self.rounds = self.prep.rounds
        self.load_seconds = time.perf_counter() - t0
        self.log(f"{t.strategy}: {self.K} replica(s) x batch {t.batch_size}, {len(self.rounds)} "
                 f"rounds of up to {self.prep.period} step(s), {self.ctx.per_epoch} steps/epoch, "
                 f"{data.n_train} training images, model {cfg.model.name}, device {device}")
        averaged = self.strategy_cls.average_payload(cfg, self.graph.payload_bytes)
        if averaged:  # how the replicas' mean travels (pipeline.averaging.algorithms)
            self.graph.averaged_bytes = averaged
            self.log(f"average: {self.graph.average_plan().description}")

    def _device(self):
        """``(device, resources train- and evaluate- tasks ask for)``: the GPU resource, or on
        the CPU ``train.cpu_resource`` when a worker advertises it (training workers beside
        loaders) and otherwise none (any worker)."""
        from pipeline.cluster import connection as cluster
        t, c = self.config.train, self.config.cluster
        cpu = ("cpu", {t.cpu_resource: 1}
               if cluster.has_resource(self.client, t.cpu_resource) else None)
        if t.device == "cpu":
            return cpu
        if t.device == "gpu":
            cluster.require_resource(self.client, t.gpu_resource, c.resource_timeout)
        elif not cluster.has_resource(self.client, t.gpu_resource):
            return cpu
        for line in cluster.check_gpu_workers(self.client, t.gpu_resource):
            self.log(f"GPU worker {line}")
        return "gpu", {t.gpu_resource: 1}

    # ---- the loop ------------------------------------------------------------------------
    def run(self, resume: bool, overwrite: bool) -> TrainOutput:
        from pipeline.training import graph
        state = self.prep.state
        if state is not None:
            self.log(f"resuming {self.out.path} after round {state.round}")
        self._setup()
        state = state or self.strategy_cls(self.ctx, self.graph).initial_state(self.initial)
        self.anchor = state
        self._stop_before_start()
        self.out.create(resume, overwrite)
        if resume:
            self.history = self.out.truncate("metrics.jsonl", lambda x: x["round"] <= state.round)
        # Wall time counts on from where the resumed run stopped: `seconds` never runs backwards.
        done = self.history[-1]["seconds"] if self.history else 0.0
        self.start = time.perf_counter() - done
        self.clock = StageClock(load_seconds=self.load_seconds, first_round=state.round + 1)
        self._start_hooks()
        progress = self._progress(state.round + 1)
        try:
            with graph.task_stream(self.client) as stream, \
                    recovery.quiet_connection_loss() as quiet:
                state = self._run_recovering(stream, progress, quiet)
        finally:
            progress.close()
            for hook in self.hooks:
                getattr(hook, "close", lambda: None)()
        return self._finish(state)

    # ---- run-output hooks and stopping on request ---------------------------------------
    def _start_hooks(self) -> None:
        from pipeline.outputs.hooks import RunInfo
        info = RunInfo(self.client, self.config, self.out.path, self.rounds, self.ctx.per_epoch,
                       self.ctx.n_classes, _dataset_label(self.config.data.source), self.history,
                       self.log)
        for hook in self.hooks:
            getattr(hook, "start", lambda info: None)(info)

    def _stop_before_start(self) -> None:
        """A stop asked for during set-up: nothing ran, nothing is written."""
        if self.stop is not None and self.stop.requested:
            where = (f"; resume: python -m pipeline train --resume {self.out.path}"
                     if self.anchor.round >= 0 else "; nothing was written")
            raise Interrupted(f"interrupted ({self.stop.name}) before round "
                              f"{self.anchor.round + 1}{where}", self.stop.exit_status)

    def _stop_now(self, attempt: recovery.Attempt, strategy, stream, progress) -> None:
        """Stop on request at this round boundary: collect the rounds in flight, checkpoint the
        state after the last of them, raise Interrupted with the one line to print."""
        while attempt.pending:
            last = attempt.pending.pop(0)
            self._collect(last, stream, strategy, progress)
            if not attempt.pending:
                state = strategy.gather(last.rnd.index, last.live)
                _check_finite(state, last.rnd)
                if self.out and self.anchor.round != state.round:
                    self.out.save_checkpoint(state, strategy.final_params(state))
                self.anchor = attempt.anchor = state
        r = self.anchor.round
        if not self.out:
            message = f"interrupted after round {r}; no --out was given, so nothing was saved"
        else:
            from pipeline.outputs.plots import save_curves
            save_curves(self.history, self.out.path / "curves.png", **self._curve_labels())
            message = (f"interrupted after round {r} of {len(self.rounds)} ({self.stop.name}); "
                       f"checkpoint saved; resume: python -m pipeline train --resume "
                       f"{self.out.path}")
        raise Interrupted(message, self.stop.exit_status)

    def _curve_labels(self) -> dict:
        cfg = self.config
        return dict(title=f"{cfg.train.strategy} K={self.K} {cfg.model.name}",
                    dataset=_dataset_label(cfg.data.source), n_classes=self.ctx.n_classes)

    def _run_recovering(self, stream, progress, quiet) -> HostState:
        """``_run_from`` the last anchor until the run is done; replay it after lost work."""
        retries, replay = 0, False
        while True:
            attempt = recovery.Attempt(self.graph.for_attempt(), self.anchor, replay)
            replay = True
            try:
                return self._run_from(attempt, stream, progress)
            except (DivergenceError, Interrupted):
                self._forget(attempt)
                raise
            except Exception as exc:
                retries = 0 if self.anchor is not attempt.anchor else retries
                decision = recovery.decide(
                    exc, recovery.ClusterState(self._scheduler_alive()), retries,
                    where=self._resume_hint(), stopped_in=self._collecting_round(),
                    scheduler=getattr(self.client.scheduler, "address", None) or "?",
                    out_given=bool(self.out))
                if isinstance(decision, recovery.GiveUp):
                    self._forget(attempt, exc if decision.error is not exc else None)
                    if decision.error is exc:
                        raise
                    quiet.keep = self.client.status != "running"  # its close logs the loss
                    raise decision.error from exc
                retries = decision.retries
                self.log(f"lost work in round {self._collecting_round()} "
                         f"({one_line(exc)}); replaying from round {self.anchor.round + 1}")
                self._forget(attempt, exc)
                self._await_workers()

    def _run_from(self, attempt: recovery.Attempt, stream, progress) -> HostState:
        """Run the rounds after the attempt's anchor; returns the final host state. Raises on
        lost work, after which a new attempt replays from the last anchor."""
        strategy = self.strategy_cls(self.ctx, attempt.graph, self.log)
        shard = _Shards(attempt, self.K, self.config.train.batch_size, self.rounds)
        strategy.restart(attempt.anchor, shard, self.out, replay=attempt.replay)
        attempt.live = strategy.scatter(attempt.anchor)
        prefetch, last = self.config.augment.prefetch, len(self.rounds) - 1
        state = attempt.anchor
        for rnd in self.rounds[attempt.anchor.round + 1:]:
            if self.stop is not None and self.stop.requested:
                self._stop_now(attempt, strategy, stream, progress)
            shard.prefetch(rnd.index + prefetch)
            submitted = strategy.submit_round(rnd, attempt.live, shard)
            attempt.live = submitted.live
            evals = []
            if self._evaluates(rnd):
                evals = attempt.graph.submit_evaluate(rnd.index, strategy.model(rnd, submitted.live),
                                                      self.ctx.eval_spec())
            attempt.pending.append(_Pending(rnd, submitted.live, submitted.metrics, evals))
            if len(attempt.pending) > 1:
                self._collect(attempt.pending.pop(0), stream, strategy, progress)
            if self._checkpoints(rnd) or self._anchors(rnd) or rnd.index == last:
                self._collect(attempt.pending.pop(0), stream, strategy, progress)
                state = strategy.gather(rnd.index, attempt.live)
                _check_finite(state, rnd)
                if self._checkpoints(rnd):
                    self.out.save_checkpoint(state, strategy.final_params(state))
                attempt.live = strategy.reroot(state, attempt.live)  # cut lineage
                self.anchor = attempt.anchor = state
        return state

    # ---- per round -------------------------------------------------------------------------
    def _evaluates(self, rnd) -> bool:
        every = self.config.eval_every
        return rnd.epoch_end or rnd.index == len(self.rounds) - 1 or (
            every > 0 and (rnd.index + 1) % every == 0)

    def _checkpoints(self, rnd) -> bool:
        every = self.config.checkpoint_every
        return bool(self.out) and (
            rnd.index == len(self.rounds) - 1 or (every > 0 and (rnd.index + 1) % every == 0))

    def _anchors(self, rnd) -> bool:
        """An anchor without a checkpoint: ``anchor_every`` rounds since the last one. Cutting
        the lineage there keeps each worker's records bounded (docs/reliability.md)."""
        every = self.config.anchor_every
        return every > 0 and rnd.index - self.anchor.round >= every

    def _collect(self, pending: _Pending, stream, strategy, progress) -> None:
        """Wait for a round, check it, report it; then the strategy logs what it needs."""
        self._emit(self._line(pending, stream, strategy), progress)
        strategy.collected(pending.rnd)

    def _line(self, pending: _Pending, stream, strategy) -> dict:
        rnd = pending.rnd
        metrics = strategy.graph.gather(pending.metrics)  # the watchdog looks while it waits
        evals = strategy.graph.gather(pending.evals) if pending.evals else []
        for stage, results in (("train", metrics), ("evaluate", evals)):
            for m in results:
                if isinstance(m.get("seconds"), (int, float)):
                    self.watchdog.observe(stage, m["seconds"])
        for m in metrics:
            if not m["finite"]:
                raise DivergenceError(
                    f"training diverged in round {rnd.index} (epoch {rnd.epoch}), replica "
                    f"{m['replica']}: {m.get('nonfinite') or 'loss'} is NaN or Inf")
        self.clock.account(stream(), collecting=rnd.index)
        return metrics_line(rnd, self.ctx.per_epoch, self.ctx.lrs(rnd)[-1], metrics, evals,
                            seconds=time.perf_counter() - self.start,
                            stage_seconds=self.clock.stage_seconds(rnd.index, strategy.stages),
                            bytes_averaged=strategy.bytes_averaged(rnd),
                            extra=strategy.round_fields(rnd, metrics))

    def _emit(self, line: dict, progress) -> None:
        if self.history and line["round"] <= self.history[-1]["round"]:
            return  # a replayed round after a recovery: already reported
        self.history.append(line)
        self.out.append("metrics.jsonl", [line])
        for hook in self.hooks:
            hook(line)
        if self.on_round:
            self.on_round(line)
        progress.update(1)
        postfix = dict(loss=f"{line['train_loss']:.3f}", acc=f"{line['train_acc']:.3f}")
        if "test_acc" in line:
            postfix["test_acc"] = f"{line['test_acc']:.3f}"
        progress.set_postfix(postfix, refresh=False)

    def _progress(self, initial: int):
        from tqdm.std import tqdm  # text bar: tqdm.auto warns in kernels without ipywidgets
        return tqdm(total=len(self.rounds), initial=initial, unit="round",
                    disable=not self.config.progress, file=sys.stderr, dynamic_ncols=True)

    # ---- recovery: the cluster side of recovery.decide -----------------------------------
    def _scheduler_alive(self, timeout: float | None = None) -> bool:
        """The client is connected and the scheduler answers a ping within ``timeout`` s
        (default ``cluster.connect_timeout``, at least 5 s).

        A busy scheduler on a loaded machine (retiring a stopped worker, say) may miss one
        5-second ping, so pings are repeated until the time is up; a closed client is gone at
        once.
        """
        deadline = time.monotonic() + (timeout if timeout is not None
                                       else max(5.0, self.config.cluster.connect_timeout))
        while self.client.status == "running":
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.client.sync(self.client.scheduler.identity, callback_timeout=min(5.0, left))
                return self.client.status == "running"
            except Exception:  # refused, closed, timed out: ask again while time is left
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return False

    def _resume_hint(self) -> str:
        return recovery.resume_hint(self.out.path, self.anchor.round, self.out.has_checkpoints())

    def _collecting_round(self) -> int:
        """The round the driver was waiting for: one after the last reported (the last round
        itself while its final state is gathered)."""
        after = self.history[-1]["round"] if self.history else self.anchor.round
        return min(after + 1, len(self.rounds) - 1)

    def _forget(self, attempt: recovery.Attempt, exc: BaseException | None = None) -> None:
        """Cancel every future of a failed attempt (the next one keys its tasks afresh).

        The traceback's frames are cleared too: their locals hold futures of the attempt.
        """
        import traceback

        from pipeline.training.graph import futures_of
        stale = futures_of(attempt.held())
        attempt.shards.clear()
        attempt.pending.clear()
        attempt.live = None
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        if stale and self._scheduler_alive():
            with contextlib.suppress(Exception):  # best effort: they are released anyway
                self.client.cancel(stale, reason="replaying from the last anchor")
        del stale

    def _await_workers(self) -> None:
        """Before a replay: at least one worker, and the train resource if the run needs one
        (a lost worker's nanny restarts it). A CPU run whose training workers do not come back
        trains on the workers left, as it would have started on them."""
        from pipeline.cluster import connection as cluster
        timeout = self.config.cluster.connect_timeout
        try:
            cluster.require_workers(self.client, 1, timeout)
            for name in self.graph.train_resources or ():
                try:
                    cluster.require_resource(self.client, name, timeout, wait=True)
                except ClusterError:
                    if self.graph.device != "cpu":
                        raise
                    self.log(f"no worker advertises {name} any more: training on any worker")
                    self.graph.train_resources = None
        except ClusterError as err:
            raise ClusterError(f"cannot replay from round {self.anchor.round + 1}: {err}"
                               f"{self._resume_hint()}") from None

    # ---- the end -------------------------------------------------------------------------
    def _finish(self, state: HostState) -> TrainOutput:
        params = self.strategy_cls(self.ctx, self.graph).final_params(state)
        model = set_state(build_model(self.config.model.name, self.ctx.n_classes), params)
        self.out.finish(model, self.history, len(self.rounds), self._curve_labels())
        path = self.out.path
        return TrainOutput(self.history, model, params, str(path) if path else None, self.config)


def _initial_params(config: Config, n_classes: int) -> dict:
    from pipeline.training import tasks
    return tasks.init_params(config.model.name, n_classes, config.seed)


class _Shards:
    """The augment- futures of an attempt, submitted ahead of training or on demand."""

    def __init__(self, attempt: recovery.Attempt, replicas: int, batch_size: int, rounds: list):
        self.attempt, self.K, self.batch_size, self.rounds = attempt, replicas, batch_size, rounds
        self.next = attempt.anchor.round + 1  # first round whose shards are not submitted

    def prefetch(self, upto: int) -> None:
        """Submit every round's shards up to round ``upto``."""
        for index in range(self.next, min(upto, len(self.rounds) - 1) + 1):
            for k in range(self.K):
                self.attempt.shards[(index, k)] = self.attempt.graph.submit_augment(
                    self.rounds[index], k, self.K, self.batch_size)
            self.next = index + 1

    def __call__(self, round_index: int, i: int):
        """The i-th shard of a round (handed over once: the consumer holds it from now on).

        A round at or before the anchor is submitted on demand: an async replica can still hold
        an earlier round's slot when the state is checkpointed."""
        self.prefetch(round_index)
        if (round_index, i) not in self.attempt.shards:
            self.attempt.shards[(round_index, i)] = self.attempt.graph.submit_augment(
                self.rounds[round_index], i, self.K, self.batch_size)
        return self.attempt.shards.pop((round_index, i))
