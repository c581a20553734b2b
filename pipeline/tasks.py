"""The functions that run inside Dask tasks: train a replica, evaluate a chunk, apply an update.

Each takes host NumPy values and small NamedTuples and returns the same kinds; the Link and the
optimizer are rebuilt (or taken from the thread's cache and overwritten) inside the task. Function
names are the dashboard's stage labels: the graph builder keys their tasks ``"<name>-<token>"``.
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import numpy as np

import augment
from pipeline import averaging
from pipeline.compat import F, chainer
from pipeline.rng import rng_for
from pipeline.state import (State, cached_model, get_optimizer_state, get_state, make_optimizer,
                            param_keys, set_lr, set_optimizer_state, set_state, setup_optimizer)


class Shard(NamedTuple):
    """One replica's data for one round: ``images`` (n, 3, 32, 32) uint8 (augmented), ``labels`` (n,) int32."""
    images: np.ndarray
    labels: np.ndarray


class StepSpec(NamedTuple):
    """Everything a train task needs besides its state and its shard."""
    model: str
    n_classes: int
    optimizer: str  # sgd | momentum | adam
    momentum: float
    weight_decay: float
    lrs: tuple  # learning rate of each local step; its length is the number of steps
    batch_size: int  # images per step
    mode: str  # "steps": take len(lrs) optimizer steps; "gradient": one gradient, no update
    opt_mode: str  # keep | reset | average (what happens to optimizer state at a mix)
    seed: int
    round: int
    replica: int
    device: str = "@numpy"  # Chainer device spec: "@numpy" or "@cupy:0"
    mean: tuple = tuple(augment.CIFAR10_MEAN)
    std: tuple = tuple(augment.CIFAR10_STD)


class TrainResult(NamedTuple):
    payload: State  # what the average- tree reduces: params (plus optimizer state when averaged),
    #                 or for mode "gradient" the gradient and the updated BatchNorm statistics
    opt: State | None  # this replica's optimizer state (kept across rounds in opt_mode "keep")
    metrics: dict  # loss_sum, correct, n, seconds, finite, replica


_MALLOC_TUNED = False


def _keep_heap_for_training() -> None:
    """Once per process: let glibc keep freed training temporaries instead of unmapping them.

    Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which also pins glibc's
    mmap threshold at 128 KiB, so every im2col buffer is a fresh mmap, page-faulted and zeroed
    again each step: a bare small-cnn loop ran 378 img/s with that variable and 501 without it
    here. Raising both thresholds restores it (618 img/s measured); a worker keeps up to 256 MiB
    of freed heap for reuse.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)


def _blas_threads():
    """Limit BLAS threads to the worker's threads so parallel tasks do not oversubscribe cores."""
    _keep_heap_for_training()
    try:
        from threadpoolctl import threadpool_limits

        from pipeline.cluster import worker_threads
        return threadpool_limits(worker_threads())
    except Exception:  # outside a worker, or threadpoolctl missing: leave BLAS alone
        return contextlib.nullcontext()


@contextlib.contextmanager
def _chainer_mode(train: bool):
    """Chainer's train flag, and no per-call type checks (inputs are ours and already checked).

    Chainer checks the types and shapes of every FunctionNode's inputs on every call. Without it
    a bare loop ran 1.04-1.07x faster at batch 100 and 1.44x for resnet20 at batch 512 on an H100
    (benchmarks/gpu.py, ``type_check_off_gain``); results are the same bits either way.
    """
    with chainer.using_config("train", train), chainer.using_config("type_check", False):
        yield


def _to_device(array, device: str):
    if device == "@numpy":
        return array
    return chainer.get_device(device).send(array)


def _inputs(images, labels, spec: StepSpec):
    """uint8 images -> normalized float32 on the task's device (uint8 is what crossed the network)."""
    x = augment.normalize(_to_device(images, spec.device), spec.mean, spec.std)
    return x, _to_device(labels.astype(np.int32, copy=False), spec.device)


def train(params: State, opt_state: State | None, shard: Shard, spec: StepSpec) -> TrainResult:
    """Run one replica for one round: ``len(spec.lrs)`` steps of ``batch_size`` from ``shard``.

    Dropout masks come from ``rng_for(seed, "dropout", round, replica)``.
    """
    start = time.perf_counter()
    if any(k.startswith("opt/") for k in params):  # opt_mode "average": the mix carried it
        opt_state = {k[4:]: v for k, v in params.items() if k.startswith("opt/")}
        params = {k: v for k, v in params.items() if not k.startswith("opt/")}
    with _blas_threads(), _chainer_mode(train=True):
        model = set_state(cached_model(spec.model, spec.n_classes, spec.device), params)
        rng = rng_for(spec.seed, "dropout", spec.round, spec.replica)
        if spec.mode == "gradient":
            return _gradient(model, shard, spec, rng, start)
        optimizer = setup_optimizer(
            make_optimizer(spec.optimizer, spec.lrs[0], spec.momentum, spec.weight_decay), model)
        if opt_state is not None and spec.opt_mode != "reset":
            set_optimizer_state(optimizer, opt_state)
        loss_sum, correct, n = _steps(model, optimizer, shard, spec, rng)
        new_params = get_state(model)
        new_opt = get_optimizer_state(optimizer)
    nonfinite = averaging.first_nonfinite(new_params)
    finite = bool(np.isfinite(loss_sum)) and nonfinite is None
    payload = dict(new_params)
    if spec.opt_mode == "average":
        payload.update({"opt/" + k: v for k, v in new_opt.items()})
    metrics = dict(loss_sum=loss_sum, correct=correct, n=n, finite=finite, replica=spec.replica,
                   nonfinite=nonfinite, seconds=time.perf_counter() - start)
    return TrainResult(payload, None if spec.opt_mode == "reset" else new_opt, metrics)


def _steps(model, optimizer, shard: Shard, spec: StepSpec, rng) -> tuple:
    """The local steps of one round -> (loss sum, correct, n) on the host, with one device sync.

    Loss and accuracy accumulate on the model's device and come back once at the end: a
    ``float(loss)`` per step would block the host on the GPU every step and serialise kernel
    launches with Python. A diverged replica runs its remaining steps on NaNs and is reported
    non-finite (the driver stops the run), rather than stopping early after a per-step sync.
    """
    loss_sum = correct = None
    n = 0
    for step, lr in enumerate(spec.lrs):
        lo = step * spec.batch_size
        x, t = _inputs(shard.images[lo:lo + spec.batch_size],
                       shard.labels[lo:lo + spec.batch_size], spec)
        logits = model(x, rng=rng)
        loss = F.softmax_cross_entropy(logits, t)
        model.cleargrads()
        loss.backward()
        set_lr(optimizer, lr)
        optimizer.update()
        batch_loss = loss.array.astype(np.float64) * len(t)
        batch_correct = (logits.array.argmax(axis=1) == t).sum()
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        n += len(t)
    if n == 0:
        return 0.0, 0, 0
    return float(loss_sum), int(correct), n  # the one sync (a no-op on NumPy)


def _gradient(model, shard: Shard, spec: StepSpec, rng, start: float) -> TrainResult:
    """Mode "gradient": the mean-loss gradient on the whole shard, no update (Distributed Gradient)."""
    x, t = _inputs(shard.images, shard.labels, spec)
    logits = model(x, rng=rng)
    loss = F.softmax_cross_entropy(logits, t)
    model.cleargrads()
    loss.backward()
    xp = chainer.backend.get_array_module(loss.array)
    tally = xp.stack([loss.array.astype(np.float64) * len(t),
                      (logits.array.argmax(axis=1) == t).sum().astype(np.float64)])
    # BatchNorm statistics as updated by this forward pass, the gradients and the two metrics
    # leave the device together (one transfer per dtype).
    payload = get_state(model, extra={"/tally": tally, **{
        path.lstrip("/"): param.grad for path, param in model.namedparams()}})
    loss_sum, correct = (float(v) for v in payload.pop("/tally"))
    metrics = dict(loss_sum=loss_sum, correct=int(correct), n=len(t),
                   finite=bool(np.isfinite(loss_sum)), replica=spec.replica,
                   seconds=time.perf_counter() - start)
    return TrainResult(payload, None, metrics)


def update(params: State, opt_state: State | None, mean: State, spec: StepSpec) -> tuple:
    """Apply one optimizer step with the averaged gradient ``mean`` (Distributed Gradient).

    ``mean`` holds the replicas' sample-weighted mean gradient for every parameter and their mean
    BatchNorm statistics. Returns ``(params, optimizer_state)``.
    """
    with _blas_threads():
        model = set_state(cached_model(spec.model, spec.n_classes, spec.device), params)
        optimizer = setup_optimizer(
            make_optimizer(spec.optimizer, spec.lrs[0], spec.momentum, spec.weight_decay), model)
        if opt_state is not None:
            set_optimizer_state(optimizer, opt_state)
        trainable = set(param_keys(model))
        for path, param in model.namedparams():
            param.grad = _to_device(mean[path.lstrip("/")], spec.device)
        optimizer.update()
        new_params = get_state(model)
        for key, value in mean.items():  # BatchNorm statistics: the replicas' mean
            if key not in trainable and np.issubdtype(value.dtype, np.floating):
                new_params[key] = value
        return new_params, get_optimizer_state(optimizer)


class EvalSpec(NamedTuple):
    model: str
    n_classes: int
    tta: bool = False
    device: str = "@numpy"
    batch_size: int = 100  # images per forward pass: bounds im2col buffers (1000 at once ran
    #                        at half the speed here)
    mean: tuple = tuple(augment.CIFAR10_MEAN)
    std: tuple = tuple(augment.CIFAR10_STD)


def predict_proba(params: State, images: np.ndarray, spec: EvalSpec) -> np.ndarray:
    """(N, 3, 32, 32) uint8 -> (N, classes) float32 softmax probabilities (TTA-averaged if asked)."""
    with _blas_threads(), _chainer_mode(train=False), chainer.no_backprop_mode():
        model = set_state(cached_model(spec.model, spec.n_classes, spec.device), params)

        def proba(batch):
            x = augment.normalize(batch, spec.mean, spec.std)
            return F.softmax(model(x)).array

        if len(images) == 0:
            return np.zeros((0, spec.n_classes), np.float32)
        device_images = _to_device(images, spec.device)  # one upload; one download below
        parts = [augment.tta_average(proba, batch) if spec.tta else proba(batch)
                 for batch in (device_images[lo:lo + spec.batch_size]
                               for lo in range(0, len(images), spec.batch_size))]
        xp = chainer.backend.get_array_module(parts[0])
        out = chainer.backend.CpuDevice().send(xp.concatenate(parts))
        return np.asarray(out, dtype=np.float32)


def evaluate(params: State, images: np.ndarray, labels: np.ndarray, spec: EvalSpec) -> dict:
    """Loss sum, correct count and size of one test chunk; summed over chunks by the driver."""
    start = time.perf_counter()
    proba = predict_proba(params, images, spec)
    labels = np.asarray(labels, dtype=np.int64)
    picked = np.clip(proba[np.arange(len(labels)), labels], 1e-12, None)
    return dict(loss_sum=float(-np.log(picked.astype(np.float64)).sum()),
                correct=int((proba.argmax(axis=1) == labels).sum()), n=int(len(labels)),
                seconds=time.perf_counter() - start)


def init_params(model: str, n_classes: int, seed: int) -> State:
    """The initial weights every replica starts from (Horovod's broadcast of rank 0's weights)."""
    from pipeline.models import build_model
    return get_state(build_model(model, n_classes, seed=seed))

