"""The functions that run inside Dask tasks: train a replica, apply a gradient, evaluate a chunk.

Each takes host NumPy values and small NamedTuples and returns the same kinds; the framework work
goes through ``pipeline.backends`` (Chainer today) with neutral device names. Function names are
the dashboard's stage labels: the graph builder keys their tasks ``"<name>-<token>"``. This
module imports neither dask nor a framework.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

import augment
from pipeline.averaging import exact
from pipeline.backends import State, get_backend
from pipeline.core.arrays import state_problem
from pipeline.core.errors import ClusterError, UsageError
from pipeline.core.rng import rng_for
from pipeline.core.threads import running_in, worker_threads
from pipeline.data.readers import Shard

if TYPE_CHECKING:
    from pipeline.backends import ModelRef, OptimizerRef


class StepSpec(NamedTuple):
    """Everything a train task needs besides its state and its shard."""
    model: str | ModelRef  # a registry name, or the user's model (its factory travels in it)
    n_classes: int
    optimizer: str | OptimizerRef  # sgd | momentum | adam | a class name of the framework's
    #                                optimizers | the user's factory (it travels in it)
    momentum: float
    weight_decay: float
    lrs: tuple  # learning rate of each local step; its length is the number of steps
    batch_size: int  # images per step
    mode: str  # "steps": take len(lrs) optimizer steps; "gradient": one gradient, no update
    seed: int
    round: int
    replica: int  # the dropout stream's second coordinate (a slot of the round for async)
    device: str = "cpu"  # neutral device name: cpu | gpu (the worker's GPU)
    mean: tuple = tuple(augment.CIFAR10_MEAN)
    std: tuple = tuple(augment.CIFAR10_STD)
    backend: str = "chainer"
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.999  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    cpu_kernels: str = "ours"  # convolution/pooling/BatchNorm on NumPy: ours | chainer
    optimizer_args: str = "{}"  # JSON keyword arguments of the optimizer
    grad_clip: float = 0.0  # L2 norm the gradient is clipped to (0: off)
    threads: int = 0  # cores of the task; 0: its worker's threads. The driver sets a worker's
    #                   threads over the replicas placed on it, so replicas sharing a worker as
    #                   threads do not oversubscribe its cores; the backend decides how a task
    #                   uses several (``Backend.using_threads``)
    displacement: bool = False  # report the squared distance the steps moved the params
    #                             (``delta_sq``, read by ipm's adaptive outer lr); off, 0.0: a
    #                             float64 pass over the state saved (18 ms a task, cifar10-2015)
    precision: str = "fp32"  # the CPU convolutions' inputs: fp32 | bf16 (train.precision)


class TrainResult(NamedTuple):
    params: State  # the replica's parameters after its steps, or for mode "gradient" the
    #                gradient and the updated BatchNorm statistics
    opt: State | None  # this replica's optimizer state after its steps (None for "gradient")
    metrics: dict  # loss_sum, correct, n, seconds, finite, nonfinite, replica


def pick(result, field: int):
    """One field of a task's tuple result, as its own key so consumers fetch only that part
    (here, not in ``graph``: a worker that runs it imports this light module, not Dask's array
    collection). A result that is not such a tuple is a ClusterError naming the task that made
    it (a worker of another version, or a hostile one), not an IndexError.

    >>> pick(("p", "o", "m"), 2)
    'm'
    >>> pick({"n": 1}, 0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    pipeline.core.errors.ClusterError: task ? returned a dict, not a tuple of at least 1 part(s) ...
    """
    if not isinstance(result, tuple) or not 0 <= field < len(result):
        worker, key = running_in()
        made_by = key[:-1] if isinstance(key, tuple) else "?"
        raise ClusterError(f"task {made_by} returned a {type(result).__name__}, not a tuple of "
                           f"at least {field + 1} part(s) (a worker of another version of this "
                           "pipeline?)" + (f"; read on worker {worker}" if key else ""))
    return result[field]


def move(value):
    """``value`` itself, on this task's worker: a prefetch to where its consumer will run."""
    return value


def train(params: State, opt_state: State | None, shard: Shard, spec: StepSpec) -> TrainResult:
    """Run one replica for one round: ``len(spec.lrs)`` steps of ``batch_size`` from ``shard``
    (mode "steps"), or one gradient on the whole shard (mode "gradient").

    ``opt_state`` None starts a fresh optimizer. Dropout masks come from
    ``rng_for(seed, "dropout", round, replica)``.
    """
    start = time.perf_counter()
    backend = get_backend(spec.backend)
    rng = rng_for(spec.seed, "dropout", spec.round, spec.replica)
    with _cores(spec), _memory_named(spec.model, shard.images, spec.batch_size):
        if spec.mode == "gradient":
            new_params, stats = backend.gradient(params, shard.images, shard.labels, spec, rng)
            new_opt = None
        else:
            new_params, new_opt, stats = backend.train_steps(params, opt_state, shard.images,
                                                             shard.labels, spec, rng)
    _check_form(new_params, new_opt, params, spec)
    nonfinite = exact.first_nonfinite(new_params)
    metrics = dict(loss_sum=stats.loss_sum, correct=stats.correct, n=stats.n,
                   delta_sq=exact.squared_distance(new_params, params)
                   if spec.mode == "steps" and spec.displacement else 0.0,
                   finite=stats.finite and nonfinite is None, replica=spec.replica,
                   nonfinite=nonfinite, seconds=time.perf_counter() - start)
    return TrainResult(new_params, new_opt, metrics)


def _check_form(new_params, new_opt, params: State, spec: StepSpec) -> None:
    """ClusterError naming the worker, task and round when the backend's output is not a state of
    its input's form (keys, dtypes, shapes) or the optimizer state not a dict: the average and the
    next round would fail on it with a bare KeyError, or average a wrong-sized array."""
    problem = state_problem(new_params, params)
    if problem is None and new_opt is not None and not isinstance(new_opt, dict):
        problem = f"an optimizer state of type {type(new_opt).__name__} (expected a dict)"
    if problem:
        worker, key = running_in()
        raise ClusterError(f"worker {worker} returned {problem} for train task {key} (round "
                           f"{spec.round}, replica {spec.replica}; a worker of another version "
                           "of this pipeline?)")


def _cores(spec):
    """The task's share of its worker's cores (``spec.threads``; 0: all of them), used as its
    backend uses them best (``Backend.using_threads``)."""
    return get_backend(spec.backend).using_threads(spec.threads or worker_threads(), spec)


@contextlib.contextmanager
def _memory_named(model: str, images: np.ndarray, batch: int):
    """A MemoryError in a task becomes one line naming the options that size it (the worker's
    traceback and a bare "out of memory" named none): ``UsageError``, so no worker logs it and the
    driver prints it as the run's last line."""
    try:
        yield
    except MemoryError:
        side = images.shape[-1] if getattr(images, "ndim", 0) == 4 else "?"
        raise UsageError(f"out of memory in a task of {model} on {side}x{side} images, batch "
                         f"{batch}: lower --image-size or --batch-size (or give the workers "
                         "more memory)") from None


def update(params: State, opt_state: State | None, mean: State, spec: StepSpec) -> tuple:
    """Apply one optimizer step with the averaged gradient ``mean`` (Distributed Gradient).

    ``mean`` holds the replicas' sample-weighted mean gradient for every parameter and their mean
    BatchNorm statistics. Returns ``(params, optimizer_state)``.
    """
    with _cores(spec):
        return get_backend(spec.backend).apply_gradient(params, opt_state, mean, spec)


class EvalSpec(NamedTuple):
    model: str | ModelRef  # as StepSpec.model
    n_classes: int
    tta: bool = False
    device: str = "cpu"
    batch_size: int = 100  # images per forward pass: bounds im2col buffers (1000 at once ran
    #                        at half the speed here)
    mean: tuple = tuple(augment.CIFAR10_MEAN)
    std: tuple = tuple(augment.CIFAR10_STD)
    backend: str = "chainer"
    cpu_kernels: str = "ours"  # as StepSpec.cpu_kernels
    threads: int = 0  # as StepSpec.threads (the same on a worker as its train tasks')
    precision: str = "fp32"  # as StepSpec.precision


def predict_proba(params: State, images: np.ndarray, spec: EvalSpec) -> np.ndarray:
    """(N, 3, 32, 32) uint8 -> (N, classes) float32 softmax probabilities (TTA-averaged if asked)."""
    with _cores(spec), _memory_named(spec.model, images, spec.batch_size):
        return get_backend(spec.backend).predict(params, images, spec)


def evaluate(params: State, images: np.ndarray, labels: np.ndarray, spec: EvalSpec) -> dict:
    """Loss sum, correct count and size of one test chunk; summed over chunks by the driver."""
    start = time.perf_counter()
    proba = predict_proba(params, images, spec)
    labels = np.asarray(labels, dtype=np.int64)
    picked = np.clip(proba[np.arange(len(labels)), labels], 1e-12, None)
    return dict(loss_sum=float(-np.log(picked.astype(np.float64)).sum()),
                correct=int((proba.argmax(axis=1) == labels).sum()), n=int(len(labels)),
                seconds=time.perf_counter() - start)


def init_params(model, n_classes: int, seed: int, backend: str = "chainer") -> State:
    """The initial weights every replica starts from (Horovod's broadcast of rank 0's weights)."""
    return get_backend(backend).init_params(model, n_classes, seed)
