"""The driver's loop, Chainer's ``Trainer.run`` over a task graph: per round the strategy submits,
the loop collects, then ``for ext in extensions: if ext.trigger(state): ext(state)``.

The single place that waits on the cluster: tasks never compute or wait. What a round submits is
the strategy's (``pipeline.training.strategies``), held by an ``attempt``; what runs after a
round is an extension (``extensions``: metrics, checkpoints, anchors, the progress bar); when, a
``triggers.Schedule``. Set-up is ``prepare``; recovery is a pure decision (``recovery``); stage
timing is ``telemetry``; the files are ``pipeline.outputs.run_dir``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from pipeline.backends import ModelRef, get_backend
from pipeline.core.config import Config
from pipeline.core.errors import ClusterError, DivergenceError, Interrupted
from pipeline.core.text import printable
from pipeline.outputs import fs
from pipeline.outputs import resume as resuming
from pipeline.outputs import run_dir as outputs
from pipeline.core.state import HostState
from pipeline.outputs.hooks import RunInfo
from pipeline.outputs.metrics import line as metrics_line
from pipeline.training import elastic, prepare, recovery, strategies
from pipeline.training.attempt import Attempt, Pending
from pipeline.training.extensions import RoundState, curve_labels, standard
from pipeline.training.prepare import Prepared, Setup
from pipeline.training.telemetry import StageClock
from pipeline.training.triggers import Schedule


class TrainOutput(NamedTuple):
    history: list  # one metrics dict per round (the lines of metrics.jsonl)
    model: object  # chainer.Link with the final (averaged) weights, on the host
    params: dict  # the same weights as a state dict
    out: str | None
    config: Config
    status: str = "done"  # "done", or "complete" when a resumed run had nothing left to do

    def __repr__(self) -> str:
        """One line, not every weight (a notebook shows the value of its last line).

        >>> TrainOutput([{"round": 0, "train_acc": .5, "test_acc": .25}, {"round": 1,
        ...              "train_acc": .625}], None, {"W": np.zeros((2, 3))}, "runs/x", None)
        TrainOutput(status='done', rounds=2, train_acc=0.625, test_acc=0.250, out='runs/x', \
parameters=6)
        """
        last = {k: v for line in self.history for k, v in line.items()}  # each key's latest
        accs = "".join(f", {k}={last[k]:.3f}" for k in ("train_acc", "test_acc") if k in last)
        count = sum(int(np.size(v)) for v in self.params.values())
        return (f"TrainOutput(status={self.status!r}, rounds={last.get('round', -1) + 1}{accs}, "
                f"out={self.out!r}, parameters={count:,})")


def _log_default(message: str) -> None:
    """A line on stderr, above the progress bar (never glued to it); file and class names in it
    are the data's, so its control characters are escaped."""
    from tqdm.std import tqdm
    tqdm.write(printable(message), file=sys.stderr)
    sys.stderr.flush()


def train(config: Config, client=None, *, model=None, optimizer=None, data=None,
          resume: bool = False, overwrite: bool = False,
          log: Callable[[str], None] | None = None,
          on_round: Callable[[dict], None] | None = None, stop=None, hooks=()) -> TrainOutput:
    """Train ``config`` on ``client`` (or on a LocalCluster/scheduler from ``config.cluster``).

    ``on_round`` is called with each round's metrics dict (live plots in notebooks). ``stop``
    (a :class:`pipeline.core.interrupt.StopRequest`) is read between rounds: once requested, the
    run finishes the rounds in flight, writes a checkpoint and raises
    :class:`pipeline.core.errors.Interrupted`. ``hooks``: extensions
    (:class:`pipeline.training.extensions.Extension`) or per-line hooks
    (:mod:`pipeline.outputs.hooks`) besides the ones the config asks for. The data, the device
    and a resumed checkpoint are checked before any cluster starts.

    ``model``: your own model, a ``chainer.Link`` class or a Python function returning one
    (keyword arguments from ``model.args``; ``n_classes=`` when it takes it), or its import path
    ``"pkg.module:factory"``; ``model.name`` records its path. A config naming an import path
    needs it named here again (a run directory never makes us import code). It is checked by one
    dry forward at the data's image size before any cluster starts.

    ``optimizer``: your own, a ``chainer.Optimizer`` class or a Python function (or its import
    path) taking no argument and returning an optimizer, or taking the model and returning one
    set up on it with its hooks (``pipeline.backends.chainer.user_optimizers``). Its learning
    rate becomes ``train.lr`` (the schedule's base) and ``train.optimizer`` records its path; a
    resume names it again. Checked by one update before any cluster starts.

    ``data``: arrays or Chainer datasets to train on instead of ``data.source``
    (pipeline.data.arrays: Dask arrays stay where their chunks are).
    """
    log = log or _log_default
    config, user_opt = prepare.user_optimizer(config, optimizer)  # before the recipes
    config = prepare.normalise(config)
    config, factory = prepare.user_model(config, model)
    out = outputs.prepare(config.out, resume, overwrite)
    config, dataset, client = prepare.given_data(config, data, client, log)
    found = resuming.load(out, config.to_dict(), log) if resume else None
    # Every data check before a cluster starts: CIFAR and synthetic data are read here, image
    # folders and file lists scanned here (local threads) for a local cluster; only the files
    # of an external cluster's run (--scheduler: they may be the workers' files) are checked by
    # scan- tasks on it. Arrays given as data= were checked by given_data.
    if dataset is None and prepare.checks_before_cluster(config, client):
        dataset = prepare.load_dataset(config)
    for note in getattr(dataset, "notes", ()):
        log(note)
    gpus = prepare.check_device(config) if client is None else ()
    spec = prepare.resolve_model(config, factory, dataset, user_opt)  # the contract: one step
    prep = prepare.plan(config, out, dataset, found, spec, user_opt) if dataset is not None \
        else None
    if prep is not None and prep.complete:
        return _already_complete(config, out, prep, log)
    from pipeline.cluster.connection import connect
    from pipeline.cluster.embedded import Roles, threads_per_worker
    with contextlib.ExitStack() as stack:
        if client is None:
            roles = Roles(config.augment.resource, config.train.cpu_resource)
            threads = threads_per_worker(config.cluster, config.train.replicas,
                                         config.model.cpu_kernels, gpus)
            local = dataclasses.replace(config.cluster, threads_per_worker=threads)
            client = stack.enter_context(connect(local, log=log, gpus=gpus, roles=roles))
        from pipeline.cluster import blas
        blas.check(client, config.cluster.blas_kernel, log, restart=True,  # workers re-import
                   timeout=max(60.0, config.cluster.connect_timeout),
                   precision=config.train.precision)
        if prep is None:
            dataset = prepare.load_dataset(config, client)
            spec = prepare.resolve_model(config, factory, dataset, user_opt)  # class count known
            prep = prepare.plan(config, out, dataset, found, spec, user_opt)
            if prep.complete:
                return _already_complete(config, out, prep, log)
        # config.json says what was trained: the data's class count (100 for CIFAR-100), its
        # kind and the image size the model was checked at
        ds = prep.dataset
        config = config.replace(**{"model.n_classes": ds.n_classes, "data.dataset": ds.kind,
                                   "model.input_size": prepare.image_size(config, ds)[0]})
        kept = prepare.kept_split(ds) if out is not None else None
        run_dir = outputs.RunDir(out, config, log, strategies.get(config.train.strategy).files,
                                 data=prepare.data_record(ds, kept is not None), kept=kept)
        try:
            return _run(client, run_dir, log, prep, stop, resume, overwrite,
                        dict(hooks=hooks, on_round=on_round))
        except BaseException:
            if out is not None and fs.restore(out):  # an overwrite with no checkpoint yet
                log(f"the new run failed before its first checkpoint; the run it was to replace "
                    f"is back in {out}")
            raise


def _already_complete(config: Config, out, prep: Prepared, log) -> TrainOutput:
    """A resume with nothing left to run: say so and return the run's final state; no cluster."""
    epochs = config.train.epochs
    log(f"{out} is complete: {len(prep.rounds)} rounds, {epochs:g} epochs; to train it longer "
        f"give more epochs: --resume {out} --epochs {epochs * 2:g}")
    path = Path(out) / "metrics.jsonl"  # a torn or garbled line is skipped
    history = (fs.read_metrics(path, last_round=1 << 62, rounds=len(prep.rounds))
               if path.exists() else [])
    params = {k: v for k, v in prep.state.params[0].items() if not k.startswith("opt/")}
    model = get_backend(config.model.backend).to_model(prep.model, prep.dataset.n_classes, params)
    return TrainOutput(history, model, params, str(out), config, status="complete")


def _run(client, out: outputs.RunDir, log, prep: Prepared, stop, resume: bool, overwrite: bool,
         extra: dict) -> TrainOutput:
    """Set the run up on the cluster, create its directory, then run its loop."""
    if prep.state is not None:
        log(f"resuming {out.path} after round {prep.state.round}")
    config = out.config
    setup = prepare.on_cluster(client, config, prep, log)
    anchor = prep.state or setup.strategy(setup.ctx, setup.graph).initial_state(setup.initial)
    _stop_before_start(stop, anchor, out)
    out.create(resume, overwrite)
    history = (out.truncate("metrics.jsonl", lambda x: x["round"] <= anchor.round,
                            records=len(prep.rounds)) if resume else [])
    schedule = Schedule.of(config, len(prep.rounds), saves=bool(out))
    extensions = standard(config, out, schedule, **extra)
    return _Loop(client, setup, out, log, stop, schedule, extensions, history, anchor).run()


def _stop_before_start(stop, anchor: HostState, out: outputs.RunDir) -> None:
    """A stop asked for during set-up: nothing ran, nothing is written. From here a signal
    only asks the loop to stop at its next round boundary."""
    if stop is not None:
        stop.in_setup = False
    if stop is not None and stop.requested:
        where = (f"; resume: {recovery.resume_command(out.path, out.config)}"
                 if anchor.round >= 0 else "; nothing was written")
        raise Interrupted(f"interrupted ({stop.name}) before round {anchor.round + 1}{where}",
                          stop.exit_status)


class _Loop:
    """A run under way on one client (Chainer's ``Trainer``): its set-up, extensions, the
    metrics lines so far, and the anchor its first attempt starts from."""

    def __init__(self, client, setup: Setup, out: outputs.RunDir, log, stop, schedule: Schedule,
                 extensions: list, history: list, anchor: HostState):
        self.client, self.setup, self.out, self.log, self.stop = client, setup, out, log, stop
        self.config, self.ctx = setup.ctx.config, setup.ctx
        self.schedule, self.extensions = schedule, extensions
        self.rounds = list(setup.ctx.plan)
        self.history, self.anchor = history, anchor
        self.clock = StageClock(load_seconds=setup.load_seconds, first_round=anchor.round + 1)
        # Wall time counts on from where a resumed run stopped: `seconds` never runs backwards.
        self.started = time.perf_counter() - (history[-1]["seconds"] if history else 0.0)
        # Rounds computed again after lost work, over the whole run (metrics.jsonl "replayed").
        self.replayed = int(history[-1].get("replayed", 0)) if history else 0
        self.workers = recovery.roster(client)  # {address: name}: who left or came back
        self.members = elastic.Membership(client, log, self.config.train.replicas)  # joins
        # read now: once the scheduler is gone the client no longer knows where it was
        self.scheduler = getattr(client.scheduler, "address", None) or "?"

    def run(self) -> TrainOutput:
        from pipeline.training import task_stream
        info = RunInfo(self.client, self.config, self.out.path, self.rounds, self.ctx.per_epoch,
                       self.ctx.n_classes, prepare.dataset_label(self.config.data.source),
                       self.history, self.log, first_round=self.anchor.round + 1)
        for extension in self.extensions:
            extension.initialize(info)
        try:
            with task_stream.reader(self.client) as stream, \
                    recovery.quiet_connection_loss() as quiet:
                state = self._recovering(stream, quiet)
            return self._finish(state, info)  # before finalize: MLflow uploads its files
        except BaseException as exc:
            for extension in self.extensions:
                extension.on_error(exc)
            raise
        finally:
            for extension in self.extensions:
                extension.finalize()

    # ---- the loop ------------------------------------------------------------------------------
    def _rounds(self, attempt: Attempt, stream) -> HostState:
        """The rounds after the attempt's anchor; returns the final state. Raises on lost work,
        after which a new attempt replays from the newest anchor."""
        attempt.begin(self.out)
        for rnd in self.rounds[attempt.start.round + 1:]:
            if self.stop is not None and self.stop.requested:
                self._stop_now(attempt, stream)
            evaluate = self.ctx.eval_spec() if self.schedule.evaluates(rnd) else None
            self.members.boundary(attempt.graph, rnd.index)  # placed again if workers changed
            attempt.submit(rnd, self.config.augment.prefetch, evaluate)
            for pending in attempt.due(self.schedule.anchors(rnd, attempt.anchor.round)):
                state = self._collect(attempt, pending, stream)
                for extension in self.extensions:
                    if extension.trigger(state):
                        extension(state)
        return attempt.anchor

    def _stop_now(self, attempt: Attempt, stream) -> None:
        """Stop on request at this round boundary: collect the rounds in flight (the state after
        the last is checkpointed), raise Interrupted with the one line to print."""
        if not attempt.pending:  # nothing in flight: the run stops at its newest anchor
            self._save_anchor(attempt)
        while attempt.pending:
            pending = attempt.pending.pop(0)
            state = self._collect(attempt, pending, stream, stopping=not attempt.pending)
            for extension in self.extensions:
                if extension.trigger(state):
                    extension(state)
        r = attempt.anchor.round  # rounds count from 0, as in metrics.jsonl and checkpoints/
        done = f"{r + 1} of {len(self.rounds)} rounds done"
        if not self.out:
            message = (f"interrupted after round {r} ({done}); no --out was given, so nothing "
                       "was saved")
        else:
            message = (f"interrupted after round {r} ({done}; {self.stop.name}); checkpoint "
                       f"saved; resume: {recovery.resume_command(self.out.path, self.out.config)}")
        raise Interrupted(message, self.stop.exit_status)

    def _save_anchor(self, attempt: Attempt) -> None:
        """Checkpoint an anchor this run reached between checkpoints (``anchor_every``)."""
        anchor = attempt.anchor
        if self.out and anchor is not self.anchor and \
                not self.schedule.checkpoints(self.rounds[anchor.round]):
            self.out.save_checkpoint(anchor, attempt.strategy.final_params(anchor))

    def _collect(self, attempt: Attempt, pending: Pending, stream,
                 stopping: bool = False) -> RoundState:
        """Wait for a round, check it, make its line; a round replayed after lost work is not
        new (its line is written already)."""
        line = self._line(attempt, pending, stream)
        self._watch_workers(pending.rnd.index)
        new = not self.history or line["round"] > self.history[-1]["round"]
        if new:
            self.history.append(line)
        anchor = stopping or self.schedule.anchors(pending.rnd, attempt.anchor.round)
        return RoundState(pending.rnd, line, new, anchor, stopping, attempt, pending)

    def _line(self, attempt: Attempt, pending: Pending, stream) -> dict:
        rnd, strategy = pending.rnd, attempt.strategy
        metrics = attempt.graph.gather(pending.metrics)  # the watchdog looks while it waits
        evals = attempt.graph.gather(pending.evals) if pending.evals else []
        _check_results(attempt.graph, (("train", pending.metrics, metrics),
                                       ("evaluate", pending.evals, evals)))
        for stage, results in (("train", metrics), ("evaluate", evals)):
            for m in results:
                if isinstance(m.get("seconds"), (int, float)):
                    self.setup.watchdog.observe(stage, m["seconds"])
        _check_updates(metrics, rnd)
        self.clock.account(stream(), collecting=rnd.index)
        return metrics_line(rnd, self.ctx.per_epoch, self.ctx.lrs(rnd)[-1], metrics, evals,
                            seconds=time.perf_counter() - self.started,
                            stage_seconds=self.clock.stage_seconds(rnd.index, strategy.stages),
                            bytes_averaged=strategy.bytes_averaged(rnd),
                            extra={**strategy.round_fields(rnd, metrics, pending.records),
                                   "replayed": self.replayed,
                                   "workers": self.members.field(rnd.index),
                                   "transfers": self.clock.transfers(rnd.index)})

    def _watch_workers(self, rnd: int) -> None:
        """One line per worker that left, or that its nanny started again, since the last
        round (the run goes on: distributed recomputed what it held)."""
        now = recovery.roster(self.client)
        if not now:
            return
        lost, restarted = recovery.worker_changes(self.workers, now)
        for name in restarted:
            self.log(f"worker {name} restarted by its nanny during round {rnd}; "
                     f"{len(now)} worker(s) now")
        for name in lost:
            self.log(f"worker {name} left during round {rnd}; {len(now)} worker(s) now")
        self.workers = now

    # ---- recovery --------------------------------------------------------------------------
    def _recovering(self, stream, quiet) -> HostState:
        """Attempts from the newest anchor until the run is done: a replay after lost work."""
        retries, anchor, replay, lost_at = 0, self.anchor, False, None
        while True:
            graph = self.setup.graph.for_attempt()  # a fresh key token
            attempt = Attempt(graph, self.setup.strategy(self.ctx, graph, self.log), anchor,
                              plan=self.rounds, replay=replay)
            try:
                return self._rounds(attempt, stream)
            except (DivergenceError, Interrupted):
                self._forget(attempt)
                raise
            except Exception as exc:
                anchor, replay = attempt.anchor, True
                if anchor is not attempt.start:  # failures in a row
                    retries, lost_at = 0, None
                now = recovery.roster(self.client)
                decision = self._decide(exc, anchor, retries, lost_at, now)
                if isinstance(decision, recovery.GiveUp):
                    self._forget(attempt, exc if decision.error is not exc else None)
                    if decision.error is exc:
                        raise
                    quiet.keep = self.client.status != "running"  # its close logs the loss
                    raise decision.error from exc
                retries = decision.retries
                lost_in = lost_at = self._collecting(anchor)
                self.log(recovery.replay_line(exc, self.workers, now, lost_in, anchor.round))
                self.workers = now or self.workers
                self.replayed += max(1, lost_in - anchor.round)
                self._forget(attempt, exc)
                recovery.await_workers(self.client, self.setup.graph,
                                       self.config.cluster.connect_timeout, self.log,
                                       replay_from=anchor.round + 1, hint=self._hint(anchor))
                self.setup.graph.ensure_data(self.log)

    def _decide(self, exc: Exception, anchor: HostState, retries: int, lost_at, now: dict):
        model = self.ctx.model_spec  # a worker gone while the user's code ran: theirs to blame
        gone = any(recovery.worker_changes(self.workers, now))
        return recovery.decide(
            exc, recovery.ClusterState(self._alive()), retries, where=self._hint(anchor),
            stopped_in=self._collecting(anchor),
            scheduler=self.scheduler,
            out_given=bool(self.out), lost_before=lost_at,
            suspect=f"model {model.path}'s train task" if gone and isinstance(model, ModelRef)
            else None)

    def _alive(self) -> bool:
        """The scheduler answers within ``cluster.connect_timeout`` (at least 5 s)."""
        return recovery.scheduler_alive(self.client,
                                        max(5.0, self.config.cluster.connect_timeout))

    def _forget(self, attempt: Attempt, exc: BaseException | None = None) -> None:
        held = recovery.plain(attempt.held())
        attempt.clear()
        recovery.forget(held, exc)

    def _hint(self, anchor: HostState) -> str:
        return recovery.resume_hint(self.out.path, anchor.round, self.out.has_checkpoint(),
                                    self.out.config)

    def _collecting(self, anchor: HostState) -> int:
        """The round the driver was waiting for: one after the last reported (the last round
        itself while its final state is gathered)."""
        after = self.history[-1]["round"] if self.history else anchor.round
        return min(after + 1, len(self.rounds) - 1)

    # ---- the end ---------------------------------------------------------------------------
    def _finish(self, state: HostState, info: RunInfo) -> TrainOutput:
        params = self.setup.strategy(self.ctx, self.setup.graph).final_params(state)
        model = get_backend(self.ctx.config.model.backend).to_model(self.ctx.model_spec,
                                                                    self.ctx.n_classes, params)
        self.out.finish(params, self.history, len(self.rounds), curve_labels(info))
        path = self.out.path
        return TrainOutput(self.history, model, params, str(path) if path else None, self.config)


def _check_results(graph, stages) -> None:
    """ClusterError naming the worker and what it returned when a task's result is not the
    metrics dict our task functions return (``metrics.result_problem``), before any is used."""
    from pipeline.outputs.metrics import result_problem
    for stage, futures, results in stages:
        if not isinstance(results, (list, tuple)):
            results = [results]
        for future, value in zip(futures, results):
            problem = result_problem(value, stage)
            if problem:
                raise ClusterError(f"worker {_holder(graph, future)} returned {problem} for "
                                   f"{stage} task {getattr(future, 'key', '?')} (a worker of "
                                   "another version of this pipeline?)")


def _holder(graph, future) -> str:
    """The worker holding ``future``'s result, or '?'."""
    try:
        held = graph.client.who_has([future]).get(future.key) or ["?"]
        return ", ".join(map(str, held))
    except Exception:  # noqa: BLE001  only for a message: never replace the error we report
        return "?"


def _check_updates(metrics: list, rnd) -> None:
    """DivergenceError naming the first replica whose update is NaN or Inf."""
    for m in metrics:
        if not m["finite"]:
            raise DivergenceError(
                f"training diverged in round {rnd.index} (epoch {rnd.epoch}), replica "
                f"{m['replica']}: {m.get('nonfinite') or 'loss'} is NaN or Inf")
