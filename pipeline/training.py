"""The driver of a run: submits rounds, collects their metrics, checkpoints, recovers, writes outputs.

The single place that calls ``gather``: tasks never compute or wait. Rounds are submitted one
ahead of the one being collected (except before a checkpoint), so a round's tasks start as soon as
the previous average lands, and augmentation runs ``augment.prefetch`` rounds ahead of training.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

import augment as aug
from pipeline import checkpoint, resume as resuming, tasks
from pipeline.checkpoint import HostState
from pipeline.config import Config
from pipeline.errors import ClusterError, DivergenceError, Interrupted, ResumeError, UsageError
from pipeline.models import build_model, check_model_name
from pipeline.schedule import continue_plan, learning_rate, round_period, steps_per_epoch
from pipeline.state import set_state

_STAGES = ("load", "decode", "augment", "train", "average", "update", "evaluate")
_OPTIONAL_STAGES = ("decode", "update")  # reported only in runs that have them
_MAX_RETRIES = 3  # consecutive recoveries from lost workers before the run gives up


class TrainOutput(NamedTuple):
    history: list  # one metrics dict per round (the lines of metrics.jsonl)
    model: object  # chainer.Link with the final (averaged) weights, on the host
    params: dict  # the same weights as a state dict
    out: str | None
    config: Config
    status: str = "done"  # "done", or "complete" when a resumed run had nothing left to do


class _Live(NamedTuple):
    """Futures of the current state: per replica params and optimizer state, outer momentum."""
    params: list
    opts: list
    outer: object


class _Pending(NamedTuple):
    rnd: object
    live: _Live  # state after this round
    metrics: list  # futures of the replicas' metric dicts
    evals: list  # futures of evaluate- results ([] when not evaluated)
    submitted: float


def _log_default(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(config: Config, client=None, *, resume: bool = False, overwrite: bool = False,
          log: Callable[[str], None] | None = None, on_round: Callable[[dict], None] | None = None,
          stop=None, hooks=()) -> TrainOutput:
    """Train ``config`` on ``client`` (or on a LocalCluster/scheduler from ``config.cluster``).

    ``on_round`` is called with each round's metrics dict (live plots in notebooks). ``stop``
    (a :class:`pipeline.interrupt.StopRequest`) is read between rounds: once requested, the run
    finishes the rounds in flight, writes a checkpoint and raises
    :class:`pipeline.errors.Interrupted`. ``hooks`` are run-output hooks (:mod:`pipeline.hooks`)
    besides the ones the config asks for. The data, the device and a resumed checkpoint are
    checked before any cluster starts.
    """
    log = log or _log_default
    config = _normalise(config)
    out = _prepare_out(config, resume, overwrite)
    found = resuming.load(out, config.to_dict(), log) if resume else None
    # CIFAR and synthetic data are checked here, before a cluster starts; image folders and
    # file lists are checked by scan- tasks on the cluster.
    dataset = _load_dataset(config) if _reads_on_driver(config) else None
    gpus = _check_device(config) if client is None else ()
    prep = _prepare(config, out, dataset, found) if dataset is not None else None
    if prep is not None and prep.complete:
        return _already_complete(config, out, prep, log)
    from pipeline.cluster import connect
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(connect(config.cluster, log=log, gpus=gpus))
        if prep is None:
            prep = _prepare(config, out, _load_dataset(config, client), found)
            if prep.complete:
                return _already_complete(config, out, prep, log)
        run = _Run(client, config, out, log, on_round)
        run.overwrite, run.stop, run.prep = overwrite, stop, prep
        run.hooks = list(hooks) + _config_hooks(config, out)
        return run.run(resume)


class _Prepared(NamedTuple):
    """What a run knows before a cluster starts: data, plan and the state it starts from."""
    dataset: object  # pipeline.data.Dataset (lazy; validated on the driver)
    rounds: list  # the plan: pipeline.schedule.Round for every round of the run
    per_epoch: int
    period: int
    state: HostState | None  # the checkpoint a resume goes on from (None: from the start)

    @property
    def complete(self) -> bool:
        return self.state is not None and self.state.round >= len(self.rounds) - 1


def _reads_on_driver(config: Config) -> bool:
    """Whether the data source is checked on the driver (CIFAR, synthetic), not in scan- tasks."""
    from pipeline.data import READERS
    cfg = config.data
    reader = next((r for r in READERS if r.claims(cfg.source, cfg)), None)
    return reader is None or reader.name in ("synthetic", "cifar")


def _load_dataset(config: Config, client=None):
    from pipeline.data import load_dataset
    cfg = config.data
    return load_dataset(cfg.source, cfg, download=cfg.download, client=client)


def _check_device(config: Config) -> list:
    """GPU ids for an embedded cluster; refuses ``--device gpu`` where it cannot work before a
    cluster starts (with ``--scheduler`` the workers' resources decide, after connecting)."""
    from pipeline.cluster import local_gpus, scheduler_address
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


def _plan(config: Config, n_train: int, done: list = ()) -> tuple[list, int, int]:
    """(rounds, steps per epoch, local steps per round) for ``config`` after the ``done`` rounds."""
    t = config.train
    per_epoch = steps_per_epoch(n_train, t.replicas, t.batch_size)
    period = round_period(t.strategy, config.average.period(per_epoch))
    rounds = continue_plan(list(done), n_train, t.replicas, t.batch_size, t.epochs, period,
                           t.strategy)
    return rounds, per_epoch, period


def _prepare(config: Config, out, dataset, found: "resuming.Resume | None") -> _Prepared:
    n_train = int(dataset.train_images.shape[0])
    state, done = None, []
    if found is not None:
        state = found.state
        if state is not None:  # the finished rounds as the checkpoint's run planned them
            before = config.replace(**{"train.epochs": found.saved["train"]["epochs"]})
            done = _plan(before, n_train)[0][:state.round + 1]
    rounds, per_epoch, period = _plan(config, n_train, done)
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
    """The whole lines of ``OUT/metrics.jsonl`` (a torn last line is dropped)."""
    lines = []
    path = Path(out) / "metrics.jsonl"
    for text in path.read_text().splitlines() if path.exists() else ():
        try:
            lines.append(json.loads(text))
        except ValueError:
            break
    return lines


def _config_hooks(config: Config, out) -> list:
    """The run-output hooks the config asks for, and the chance-level watch every run has."""
    from pipeline import hooks
    chosen = [hooks.ChanceWatch()]
    if out is not None and config.csv:
        chosen.append(hooks.CSVLog(Path(out) / "metrics.csv"))
    if out is not None and config.tensorboard:
        chosen.append(hooks.TensorBoardLog(Path(out) / "tensorboard"))
    return chosen


def _normalise(config: Config) -> Config:
    config.validate()
    check_model_name(config.model.name)
    aug.get_policy(config.augment.policy)  # ValueError naming augment.policy
    if config.train.strategy == "single" and config.train.replicas != 1:
        raise UsageError("train.replicas must be 1 for strategy single")
    return config


def _prepare_out(config: Config, resume: bool, overwrite: bool) -> Path | None:
    """Check the output directory without creating it: a run refused later (bad data, no
    worker, unreachable scheduler) must leave nothing behind. ``_make_out`` creates it."""
    if config.out is None:
        if resume:
            raise UsageError("resume needs an output directory (--out)")
        return None
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output directory {out} exists and is not a directory")
    if not resume and out.is_dir() and (out / "metrics.jsonl").exists() and not overwrite:
        if not resuming.has_checkpoint(out) and not resuming.finished(out):
            raise UsageError(f"{out} holds a run that stopped before its first checkpoint: start "
                             f"it again with --resume {out}, or replace it with --overwrite")
        raise UsageError(f"{out} already holds a run; resume it with --resume {out} (add --epochs "
                         "N to train it longer) or pick another --out")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create output directory {out}: {parent} is not a writable "
                         "directory")
    return out


def _make_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Create the output directory once the run is under way; clear a replaced run's outputs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create output directory {out}: {exc.strerror}") from None
    if not resume and overwrite:
        for name in ("metrics.jsonl", "metrics.csv", "model.npz", "curves.png", "summary.json"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.rmtree(out / "tensorboard", ignore_errors=True)


def _round_of(key) -> int | None:
    match = re.match(r"\('?\"?[a-z_]+-[0-9a-f]{8}'?\"?, (\d+)", str(key))
    return int(match.group(1)) if match else None


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (distributed's messages carry newlines and hints)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _ConnectionLossFilter(logging.Filter):
    """Drops distributed's own reports of a closed scheduler connection (tracebacks of
    CommClosedError, a cancelled reconnect): the driver reports a lost scheduler in one line."""

    keep = False  # stay installed after the run: the client's close still logs the loss

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (OSError, asyncio.CancelledError)):  # CommClosedError is an OSError
            return False
        return not str(record.msg).startswith(("Batched Comm Closed", "Failed to reconnect"))


_QUIETED = ("distributed.batched", "distributed.client", "distributed.core", "distributed.utils",
            "distributed.comm.tcp")


@contextlib.contextmanager
def _quiet_connection_loss():
    """Install a ``_ConnectionLossFilter`` on distributed's connection loggers for a run."""
    quiet = _ConnectionLossFilter()
    loggers = [logging.getLogger(name) for name in _QUIETED]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield quiet
    finally:
        if not quiet.keep:
            for logger in loggers:
                logger.removeFilter(quiet)


class _Run:
    """One training run on one client."""

    def __init__(self, client, config: Config, out: Path | None, log, on_round):
        self.client, self.config, self.out, self.log, self.on_round = (
            client, config, out, log, on_round)
        self.history: list[dict] = []
        self.stage_by_round: dict[int, dict] = {}
        self.intervals_by_round: dict[int, list] = {}

    # ---- set-up --------------------------------------------------------------------------
    def _setup(self):
        from pipeline import cluster, graph
        cfg = self.config
        t0 = time.perf_counter()
        dataset = self.prep.dataset
        self.n_classes = dataset.n_classes
        device, train_res = self._device()
        augment_res = ({cfg.augment.resource: 1}
                       if cluster.has_resource(self.client, cfg.augment.resource) else None)
        data = graph.persist_dataset(self.client, dataset)
        if data.note:
            self.log(data.note)
        self.graph = graph.RoundGraph(self.client, data, cfg, n_classes=self.n_classes,
                                      device=device, train_resources=train_res,
                                      augment_resources=augment_res)
        t = cfg.train
        self.K = t.replicas
        self.per_epoch, period, self.rounds = self.prep.per_epoch, self.prep.period, self.prep.rounds
        self.warmup_steps = int(round(t.warmup_epochs * self.per_epoch))
        self.opt_mode = cfg.average.optimizer_state if t.strategy == "ipm" else "keep"
        self.device = device
        self.load_seconds = time.perf_counter() - t0
        self.log(f"{t.strategy}: {self.K} replica(s) x batch {t.batch_size}, {len(self.rounds)} "
                 f"rounds of up to {period} step(s), {self.per_epoch} steps/epoch, "
                 f"{data.n_train} training images, model {cfg.model.name}, device {device}")

    def _device(self):
        from pipeline import cluster
        t, c = self.config.train, self.config.cluster
        if t.device == "cpu":
            return "@numpy", None
        if t.device == "gpu":
            cluster.require_resource(self.client, t.gpu_resource, c.resource_timeout)
        elif not cluster.has_resource(self.client, t.gpu_resource):
            return "@numpy", None
        for line in cluster.check_gpu_workers(self.client, t.gpu_resource):
            self.log(f"GPU worker {line}")
        return "@cupy:0", {t.gpu_resource: 1}

    def _spec(self, rnd, replica: int, mode: str = "steps") -> tasks.StepSpec:
        t = self.config.train
        lrs = tuple(learning_rate(t.lr, self.K, t.lr_scaling, self.warmup_steps, s)
                    for s in range(rnd.global_step, rnd.global_step + rnd.steps))
        return tasks.StepSpec(self.config.model.name, self.n_classes, t.optimizer, t.momentum,
                              t.weight_decay, lrs, t.batch_size, mode, self.opt_mode,
                              self.config.seed, rnd.index, replica, self.device)

    def _eval_spec(self) -> tasks.EvalSpec:
        return tasks.EvalSpec(self.config.model.name, self.n_classes, self.config.train.tta,
                              self.device)

    # ---- state on the host and on the cluster -------------------------------------------
    def _initial_state(self) -> HostState:
        params = tasks.init_params(self.config.model.name, self.n_classes, self.config.seed)
        return HostState(-1, [params] * self.K, [None] * self.K, None)

    def _shared(self) -> bool:
        return self.config.train.strategy in ("ipm", "gradient")

    def _scatter(self, state: HostState) -> _Live:
        """Host state -> futures with no lineage (a fresh root for the rounds that follow)."""
        g = self.graph
        if self._shared() or state.round < 0:
            params = [g.scatter(state.params[0])] * self.K
        else:
            params = [g.scatter(p) for p in state.params]
        opts = [g.scatter(o) if o is not None else None for o in state.opts]
        if self.config.train.strategy == "gradient" and state.opts[0] is not None:
            opts = [opts[0]] * self.K
        outer = g.scatter(state.outer) if state.outer is not None else None
        return _Live(params, opts, outer)

    def _gather_state(self, rnd_index: int, live: _Live) -> HostState:
        params, opts, outer = self.client.gather([live.params, live.opts, live.outer])
        return HostState(rnd_index, params, opts, outer)

    # ---- one round -----------------------------------------------------------------------
    def _submit_augment(self, upto: int, augments: dict):
        t = self.config.train
        for index in range(self._first_unsubmitted_aug, min(upto, len(self.rounds) - 1) + 1):
            rnd = self.rounds[index]
            for k in range(self.K):
                augments[(index, k)] = self.graph.submit_augment(rnd, k, self.K, t.batch_size)
            self._first_unsubmitted_aug = index + 1

    def _submit_round(self, rnd, live: _Live, augments: dict) -> _Pending:
        g, strategy = self.graph, self.config.train.strategy
        shards = [augments.pop((rnd.index, k)) for k in range(self.K)]
        if strategy == "gradient":
            outs = [g.submit_train(rnd, k, live.params[0], None, shards[k],
                                   self._spec(rnd, k, "gradient")) for k in range(self.K)]
            params, opt = g.submit_gradient_update(rnd, [o[0] for o in outs], live.params[0],
                                                   live.opts[0], self._spec(rnd, 0))
            new = _Live([params] * self.K, [opt] * self.K, None)
        else:
            outs = [g.submit_train(rnd, k, live.params[k], live.opts[k], shards[k],
                                   self._spec(rnd, k)) for k in range(self.K)]
            opts = [o[1] for o in outs]
            if rnd.mix:
                params, outer = g.submit_average(rnd, [o[0] for o in outs], live.params[0],
                                                 live.outer)
                new = _Live([params] * self.K, opts, outer)
            else:
                new = _Live([o[0] for o in outs], opts, live.outer)
        evals = []
        if self._evaluates(rnd):
            evals = g.submit_evaluate(rnd.index, self._model_params(rnd, new), self._eval_spec())
        return _Pending(rnd, new, [o[2] for o in outs], evals, time.perf_counter())

    def _model_params(self, rnd, live: _Live):
        """Future of 'the model' after ``rnd``: the shared params, or for mixture mid-run the
        replicas' average (what stopping here would give)."""
        if self._shared() or rnd.mix or self.K == 1:
            return live.params[0]
        params, _ = self.graph.submit_average(rnd, live.params, live.params[0], None)
        return params

    def _evaluates(self, rnd) -> bool:
        every = self.config.eval_every
        return rnd.epoch_end or rnd.index == len(self.rounds) - 1 or (
            every > 0 and (rnd.index + 1) % every == 0)

    def _checkpoints(self, rnd) -> bool:
        every = self.config.checkpoint_every
        return self.out is not None and (
            rnd.index == len(self.rounds) - 1 or (every > 0 and (rnd.index + 1) % every == 0))

    # ---- collecting ----------------------------------------------------------------------
    def _collect(self, pending: _Pending, stream) -> dict:
        rnd = pending.rnd
        metrics = self.client.gather(pending.metrics)
        evals = self.client.gather(pending.evals) if pending.evals else []
        self._collecting = rnd.index
        for m in metrics:
            if not m["finite"]:
                raise DivergenceError(
                    f"training diverged in round {rnd.index} (epoch {rnd.epoch}), replica "
                    f"{m['replica']}: {m.get('nonfinite') or 'loss'} is NaN or Inf")
        self._account(stream())
        n = sum(m["n"] for m in metrics)
        line = dict(round=rnd.index, epoch=rnd.epoch,
                    epoch_float=round((rnd.global_step + rnd.steps) / self.per_epoch, 6),
                    step=rnd.global_step + rnd.steps,
                    train_loss=sum(m["loss_sum"] for m in metrics) / n,
                    train_acc=sum(m["correct"] for m in metrics) / n,
                    lr=self._spec(rnd, 0).lrs[-1], images=n)
        if evals:
            m = sum(e["n"] for e in evals)
            line.update(test_loss=sum(e["loss_sum"] for e in evals) / m,
                        test_acc=sum(e["correct"] for e in evals) / m)
        line["seconds"] = round(time.perf_counter() - self.start, 4)
        line["stage_seconds"] = self._stage_seconds(rnd.index)
        line["bytes_averaged"] = self._bytes_averaged(rnd)
        return line

    def _account(self, records: list) -> None:
        for rec in records:
            r = _round_of(rec.get("key"))
            stage = str(rec.get("key", "")).split("-")[0].strip("('\"")
            block = stage == "decode" and len(rec.get("key", ())) == 2  # a cached image block
            if stage in ("load", "images", "labels") or block:  # keyed by block, not by round:
                stage, r = "load", self._collecting  # charge the round being collected
            if r is None or stage not in _STAGES:
                continue
            stages = self.stage_by_round.setdefault(r, {})
            for ss in rec.get("startstops", ()):
                if ss.get("action") == "compute":
                    stages[stage] = stages.get(stage, 0.0) + ss["stop"] - ss["start"]
                    self.intervals_by_round.setdefault(r, []).append((ss["start"], ss["stop"]))

    def _stage_seconds(self, r: int) -> dict:
        stages = {s: round(v, 4) for s, v in self.stage_by_round.pop(r, {}).items()}
        stages = {s: stages.get(s, 0.0) for s in _STAGES if s not in _OPTIONAL_STAGES
                  or s in stages}
        if r == self._first_collected:
            stages["load"] = round(self.load_seconds + stages.get("load", 0.0), 4)
        intervals = sorted(self.intervals_by_round.pop(r, []))
        busy, end = 0.0, -np.inf
        for lo, hi in intervals:  # length of the union of compute intervals
            busy += max(0.0, hi - max(lo, end))
            end = max(end, hi)
        wall = time.perf_counter() - self._last_collect
        self._last_collect = time.perf_counter()
        stages["waiting"] = round(max(0.0, wall - busy), 4)
        return stages

    def _bytes_averaged(self, rnd) -> int:
        if not rnd.mix:
            return 0
        per_replica = self.payload_bytes * (2 if self.opt_mode == "average" else 1)
        return int(per_replica * self.K)

    # ---- the loop ------------------------------------------------------------------------
    def run(self, resume: bool) -> TrainOutput:
        from pipeline import averaging, graph
        state = self.prep.state
        if state is not None:
            self.log(f"resuming {self.out} after round {state.round}")
        self._setup()
        state = state or self._initial_state()
        self.payload_bytes = averaging.nbytes(state.params[0])
        self._anchor = state
        self._stop_before_start()
        if self.out is not None:
            _make_out(self.out, resume, self.overwrite)
            checkpoint.write_atomic(self.out / "config.json", self.config.to_json())
        if resume:
            self._truncate_metrics(state.round)
            for name in checkpoint.remove_temporaries(self.out):  # a killed driver's half-writes
                self.log(f"removed {name}, left by an interrupted write")
        # Wall time counts on from where the resumed run stopped: `seconds` never runs backwards.
        done = self.history[-1]["seconds"] if self.history else 0.0
        self.start = time.perf_counter() - done
        self._last_collect = time.perf_counter()
        self._first_collected = state.round + 1
        self._start_hooks()
        progress = self._progress(state.round + 1)
        self._attempt: dict = {}
        try:
            with graph.task_stream(self.client) as stream, _quiet_connection_loss() as quiet:
                state = self._run_recovering(stream, progress, quiet)
        finally:
            progress.close()
            for hook in self.hooks:
                getattr(hook, "close", lambda: None)()
        return self._finish(state)

    # ---- run-output hooks and stopping on request ---------------------------------------
    def _start_hooks(self) -> None:
        from pipeline.hooks import RunInfo
        info = RunInfo(self.client, self.config, self.out, self.rounds, self.per_epoch,
                       self.n_classes, _dataset_label(self.config.data.source), self.history,
                       self.log)
        for hook in self.hooks:
            getattr(hook, "start", lambda info: None)(info)

    def _stop_before_start(self) -> None:
        """A stop asked for during set-up: nothing ran, nothing is written."""
        if self.stop is not None and self.stop.requested:
            where = (f"; resume: python -m pipeline train --resume {self.out}"
                     if self._anchor.round >= 0 else "; nothing was written")
            raise Interrupted(f"interrupted ({self.stop.name}) before round "
                              f"{self._anchor.round + 1}{where}", self.stop.exit_status)

    def _stop_now(self, pending: list, stream, progress) -> None:
        """Stop on request at this round boundary: collect the rounds in flight, checkpoint the
        state after the last of them, raise Interrupted with the one line to print."""
        while pending:
            last = pending.pop(0)
            self._emit(self._collect(last, stream), progress)
            if not pending:
                state = self._gather_state(last.rnd.index, last.live)
                if self.out is not None and self._anchor.round != state.round:
                    self._save_checkpoint(state)
                self._anchor = state
        r = self._anchor.round
        if self.out is None:
            message = f"interrupted after round {r}; no --out was given, so nothing was saved"
        else:
            from pipeline.plots import save_curves
            save_curves(self.history, self.out / "curves.png", **self._curve_labels())
            message = (f"interrupted after round {r} of {len(self.rounds)} ({self.stop.name}); "
                       f"checkpoint saved; resume: python -m pipeline train --resume {self.out}")
        raise Interrupted(message, self.stop.exit_status)

    def _curve_labels(self) -> dict:
        cfg = self.config
        return dict(title=f"{cfg.train.strategy} K={self.K} {cfg.model.name}",
                    dataset=_dataset_label(cfg.data.source), n_classes=self.n_classes)

    def _run_recovering(self, stream, progress, quiet: "_ConnectionLossFilter") -> HostState:
        """``_run_from`` the last anchor until the run is done; replay it after lost work.

        Gives up on a lost scheduler, on an error that is not lost work, and after
        ``_MAX_RETRIES`` failures in a row without a new anchor.
        """
        retries = 0
        while True:
            anchor = self._anchor
            try:
                return self._run_from(anchor, stream, progress)
            except (DivergenceError, Interrupted):
                self._forget_attempt()
                raise
            except Exception as exc:
                retries = 1 if self._anchor is not anchor else retries + 1
                if not self._recoverable(exc) or retries > _MAX_RETRIES:
                    fatal = self._fatal(exc, retries)
                    self._forget_attempt(exc if fatal is not exc else None)
                    if fatal is exc:
                        raise
                    quiet.keep = self.client.status != "running"  # its close logs the loss
                    raise fatal from exc
                self.log(f"lost work in round {self._collecting_round()} "
                         f"({_one_line(exc)}); replaying from round {self._anchor.round + 1}")
                self._forget_attempt(exc)
                self._await_workers()

    def _run_from(self, anchor: HostState, stream, progress) -> HostState:
        """Run the rounds after ``anchor``; returns the final host state. Raises on lost work,
        after which ``run`` replays from the last anchor (a checkpoint, or the start)."""
        augments: dict = {}
        pending: list[_Pending] = []
        self._attempt = attempt = dict(augments=augments, pending=pending)  # cancelled on a fault
        live = attempt["live"] = self._scatter(anchor)
        self._first_unsubmitted_aug = anchor.round + 1
        prefetch = self.config.augment.prefetch
        state = anchor
        for rnd in self.rounds[anchor.round + 1:]:
            if self.stop is not None and self.stop.requested:
                self._stop_now(pending, stream, progress)
            self._submit_augment(rnd.index + prefetch, augments)
            pending.append(self._submit_round(rnd, live, augments))
            live = attempt["live"] = pending[-1].live
            if len(pending) > 1:
                self._emit(self._collect(pending.pop(0), stream), progress)
            if self._checkpoints(rnd) or rnd.index == len(self.rounds) - 1:
                self._emit(self._collect(pending.pop(0), stream), progress)
                state = self._gather_state(rnd.index, live)
                if self._checkpoints(rnd):
                    self._save_checkpoint(state)
                live = attempt["live"] = self._scatter(state)  # cut lineage: a fresh root
                self._anchor = state
        return state

    def _emit(self, line: dict, progress) -> None:
        if self.history and line["round"] <= self.history[-1]["round"]:
            return  # a replayed round after a recovery: already reported
        self.history.append(line)
        if self.out is not None:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")  # one write per whole line
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

    # ---- recovery -----------------------------------------------------------------------
    def _recoverable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is work lost with a worker, which a replay from the last anchor redoes.

        Distributed recomputes a lost key from its lineage by itself; what reaches the driver is
        what it cannot: a task that killed its workers (KilledWorker), keys forgotten because a
        scattered root (the anchor's state) or a dependency died with its worker
        (FutureCancelledError "already forgotten" / "lost dependencies"), a scatter to a worker
        that just died (OSError). A lost scheduler is never recoverable: it held every key.
        """
        import distributed
        from distributed.client import FutureCancelledError, FuturesCancelledError
        lost = (distributed.KilledWorker, FutureCancelledError, FuturesCancelledError, OSError)
        return isinstance(exc, lost) and self._scheduler_alive()

    def _scheduler_alive(self, timeout: float = 5.0) -> bool:
        """The client is connected and the scheduler answers a ping within ``timeout`` s."""
        if self.client.status != "running":
            return False
        try:
            self.client.sync(self.client.scheduler.identity, callback_timeout=timeout)
        except Exception:  # refused, closed, timed out: gone
            return False
        return self.client.status == "running"

    def _fatal(self, exc: BaseException, retries: int = 0) -> BaseException:
        """The error that ends the run: one line that says where it stopped and how to resume."""
        import distributed
        from distributed.client import FutureCancelledError, FuturesCancelledError
        cluster_kind = (distributed.KilledWorker, FutureCancelledError, FuturesCancelledError,
                        OSError)
        if not isinstance(exc, cluster_kind):
            return exc  # a bug or a user error: the caller sees it unchanged
        where = self._resume_hint()
        if not self._scheduler_alive():
            address = getattr(self.client.scheduler, "address", None) or "?"
            hint = " (and --scheduler ADDR for a new scheduler)" if self.out is not None else ""
            return ClusterError(f"lost the scheduler {address} while waiting for round "
                                f"{self._collecting_round()}{where}{hint}")
        return ClusterError(f"gave up after losing work {retries} times in a row, last in round "
                            f"{self._collecting_round()} ({_one_line(exc)}){where}")

    def _resume_hint(self) -> str:
        """``; <where the run can go on from>`` for the error that ends it."""
        if self.out is None:
            return "; no --out was given, so there is nothing to resume"
        if self._anchor.round >= 0 and (self.out / "checkpoints").is_dir():
            return (f"; the last checkpoint is round {self._anchor.round}: resume with "
                    f"`python -m pipeline train --resume {self.out}`")
        return f"; no checkpoint yet: start again with --out {self.out} --overwrite"

    def _collecting_round(self) -> int:
        """The round the driver was waiting for: one after the last reported (the last round
        itself while its final state is gathered)."""
        after = self.history[-1]["round"] if self.history else self._anchor.round
        return min(after + 1, len(self.rounds) - 1)

    def _forget_attempt(self, exc: BaseException | None = None) -> None:
        """Cancel every future of the failed attempt and key the replay under a fresh token.

        Replayed tasks get new keys, so they never meet a stale key the scheduler is still
        forgetting (re-submitting a key being cancelled leaves its future cancelled or hanging).
        The traceback's frames are cleared too: their locals hold futures of the attempt.
        """
        import traceback
        import uuid
        import distributed
        stale = distributed.futures_of(list(self._attempt.values()))
        self._attempt = {}
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        if stale and self._scheduler_alive():
            with contextlib.suppress(Exception):  # best effort: they are released anyway
                self.client.cancel(stale, reason="replaying from the last anchor")
        del stale
        self.graph.token = uuid.uuid4().hex[:8]

    def _await_workers(self) -> None:
        """Before a replay: at least one worker, and the train resource if the run needs one."""
        from pipeline import cluster
        timeout = self.config.cluster.connect_timeout
        try:
            cluster.require_workers(self.client, 1, timeout)
            for name in self.graph.train_resources or ():
                cluster.require_resource(self.client, name, timeout)
        except ClusterError as err:
            raise ClusterError(f"cannot replay from round {self._anchor.round + 1}: {err}"
                               f"{self._resume_hint()}") from None

    # ---- checkpoints and outputs ---------------------------------------------------------
    def _final_params(self, state: HostState) -> dict:
        """The model's weights: the shared (averaged) params; for single, the one replica; for
        mixture, the average after the last round (replica 0 in a mid-run checkpoint)."""
        return {k: v for k, v in state.params[0].items() if not k.startswith("opt/")}

    def _save_checkpoint(self, state: HostState) -> None:
        checkpoint.save(self.out, state, self._final_params(state), self._comparable())

    def _comparable(self) -> dict:
        """The config a checkpoint records: all but where and how the run ran (its epochs kept:
        a resume plans the finished rounds by them)."""
        return {k: v for k, v in self.config.to_dict().items() if k not in resuming.RESUMABLE}

    def _truncate_metrics(self, last_round: int) -> None:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                break  # a torn last line from a killed driver
            if line["round"] <= last_round:
                kept.append(line)
        self.history = kept
        checkpoint.write_atomic(path, "".join(json.dumps(x) + "\n" for x in kept))

    def _finish(self, state: HostState) -> TrainOutput:
        params = self._final_params(state)
        model = set_state(build_model(self.config.model.name, self.n_classes), params)
        if self.out is not None:
            from pipeline.compat import serializers
            from pipeline.plots import save_curves
            tmp = self.out / ".model.npz.tmp.npz"
            serializers.save_npz(str(tmp), model)
            tmp.replace(self.out / "model.npz")
            save_curves(self.history, self.out / "curves.png", **self._curve_labels())
            last = self.history[-1] if self.history else {}
            summary = dict(status="done", rounds=len(self.rounds),
                           epochs=self.config.train.epochs, seconds=last.get("seconds"),
                           train_acc=last.get("train_acc"), test_acc=last.get("test_acc"),
                           test_loss=last.get("test_loss"), model=self.config.model.name,
                           n_classes=self.n_classes,
                           dataset=_dataset_label(self.config.data.source))
            checkpoint.write_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
        return TrainOutput(self.history, model, params, str(self.out) if self.out else None,
                           self.config)



def _dataset_label(source: str) -> str:
    """A short name for the data in titles: the directory or archive name, or synthetic:N:M.

    >>> _dataset_label("/data/cifar-10-batches-py/"), _dataset_label("synthetic")
    ('cifar-10-batches-py', 'synthetic')
    """
    return Path(str(source).rstrip("/")).name or str(source)
