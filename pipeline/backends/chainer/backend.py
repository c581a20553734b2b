"""The Chainer backend: the task-side operations of ``pipeline.backends`` on Chainer Links and optimizers.

The Link and the optimizer are rebuilt (or taken from the thread's cache and overwritten) inside
each call; only host NumPy dicts go in and out (``pipeline.backends.chainer.state``). Neutral device names map to
Chainer's: ``"cpu"`` -> ``"@numpy"``, ``"gpu"`` -> ``"@cupy:0"`` (a GPU worker sees one device).
"""
from __future__ import annotations

import contextlib
import json

import numpy as np

import augment
from pipeline.backends import ModelRef, OptimizerRef, State, StepStats
from pipeline.backends.chainer import compat
from pipeline.backends.chainer.compat import F, chainer
from pipeline.backends.chainer.cpu_kernels import stock as stock_kernels
from pipeline.backends.chainer.gpu_kernels import fused_update
from pipeline.backends.chainer.state import (build, cached_model, get_optimizer_state,
                                             get_state, load_npz, make_optimizer, param_keys,
                                             set_lr, set_optimizer_state, set_state,
                                             setup_optimizer)
from pipeline.core.errors import UsageError, one_line
from pipeline.core.threads import limit_blas_threads

_CHAINER_DEVICE = {"cpu": "@numpy", "gpu": "@cupy:0"}
_MALLOC_TUNED = False


def chainer_device(device: str) -> str:
    """Chainer's device spec for a neutral name (Chainer's own specs pass through).

    >>> chainer_device("gpu"), chainer_device("@numpy")
    ('@cupy:0', '@numpy')
    """
    return _CHAINER_DEVICE.get(device, device)


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


def _to_device(array, device: str):
    device = chainer_device(device)
    if device == "@numpy":
        return array
    return chainer.get_device(device).send(array)


def _host(array) -> np.ndarray:
    return np.asarray(chainer.backend.CpuDevice().send(array))


def _inputs(images, labels, spec):
    """uint8 images -> normalized float32 on the task's device (uint8 is what crossed the network)."""
    x = augment.normalize(_to_device(images, spec.device), spec.mean, spec.std)
    return x, _to_device(labels.astype(np.int32, copy=False), spec.device)


def _mode(train: bool, kernels: str = "ours"):
    """Chainer's train flag, which CPU kernels run (``pipeline.backends.chainer.cpu_kernels``: ours | chainer), and
    no per-call type checks (inputs are ours and already checked).

    Chainer checks the types and shapes of every FunctionNode's inputs on every call. Without it
    a bare loop ran 1.04-1.07x faster at batch 100 and 1.44x for resnet20 at batch 512 on an H100
    (benchmarks/gpu.py, ``type_check_off_gain``); results are the same bits either way.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(chainer.using_config("train", train))
    stack.enter_context(chainer.using_config("type_check", False))
    stack.enter_context(chainer.using_config("cpu_kernels", kernels))
    return stack


def _model(spec, params: State):
    # a model built from Chainer's stock links and functions runs our CPU kernels too
    stock_kernels.install()
    with _user_code(spec, "factory"):
        link = cached_model(spec.model, spec.n_classes, chainer_device(spec.device))
    return set_state(link, params)


@contextlib.contextmanager
def _user_code(spec, stage: str):
    """An error the user's model raises in a task (``stage``: factory, forward, backward,
    update) becomes one line naming the model, the stage and the round: ``UsageError``, so the
    worker does not log it and the driver ends the run with it (exit 2 in the CLI). A
    MemoryError keeps its own line (``tasks._memory_named``); our registry's models are ours:
    their errors keep their tracebacks."""
    if not isinstance(spec.model, ModelRef):
        yield
        return
    try:
        yield
    except MemoryError:
        raise
    except (Exception, SystemExit) as exc:  # SystemExit: sys.exit() in the user's forward
        text = str(exc) if isinstance(exc, UsageError) else one_line(exc, limit=200)
        where = (f"in round {spec.round} (replica {spec.replica})" if hasattr(spec, "round")
                 else "in an evaluate task")
        raise UsageError(f"model {spec.model.path} failed in its {stage} {where} on a worker: "
                         f"{text}") from None


def _forward(model, x, spec, rng):
    """Our registry's models take the dropout generator; a user's model is called as written."""
    return model(x, rng=rng) if isinstance(spec.model, str) else model(x)


def _seeded(spec):
    """A user's model may draw from the global RNGs (``F.dropout``): seeded from the run seed
    keyed by (round, replica) for the task's steps, one such task at a time per process."""
    if isinstance(spec.model, ModelRef) and spec.model.global_rng:
        from pipeline.backends.chainer.user_models import seeded_globals
        return seeded_globals(spec.seed, "dropout", spec.round, spec.replica)
    return contextlib.nullcontext()


def _optimizer(spec, model, opt_state: State | None):
    if isinstance(spec.optimizer, OptimizerRef):  # the user's factory, its hooks its own
        from pipeline.backends.chainer.user_optimizers import create
        with _user_code(spec, "optimizer factory"):
            optimizer = create(spec.optimizer, model)
        set_lr(optimizer, spec.lrs[0])
    else:
        optimizer = setup_optimizer(
            make_optimizer(spec.optimizer, spec.lrs[0], spec.momentum, spec.weight_decay,
                           (spec.beta1, spec.beta2), spec.eps, spec.optimizer_args,
                           spec.grad_clip), model)
    if opt_state is not None:
        set_optimizer_state(optimizer, opt_state)
    return optimizer


def _steps(model, optimizer, images, labels, spec, rng) -> tuple:
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
        x, t = _inputs(images[lo:lo + spec.batch_size], labels[lo:lo + spec.batch_size], spec)
        with _user_code(spec, "forward"):
            logits = _forward(model, x, spec, rng)
            loss = F.softmax_cross_entropy(logits, t)
        model.cleargrads()
        with _user_code(spec, "backward"):
            loss.backward()
        set_lr(optimizer, lr)
        with _user_code(spec, "update"):
            fused_update.update(optimizer)  # one kernel on CuPy, Chainer's update otherwise
        batch_loss = loss.array.astype(np.float64) * len(t)
        batch_correct = (logits.array.argmax(axis=1) == t).sum()
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        n += len(t)
    if n == 0:
        return 0.0, 0, 0
    return float(loss_sum), int(correct), n  # the one sync (a no-op on NumPy)


def _dry_update(optimizer) -> None:
    """One update of ``optimizer`` (set up with its hooks) on a 2 -> 2 Linear, on the host."""
    from pipeline.backends.chainer.user_optimizers import dry_update
    dry_update(lambda link: setup_optimizer(optimizer, link))


# what an optimizer by name takes from the train section, and its hooks: a factory's own
BY_NAME_ONLY = (("weight_decay", 0.0, "WeightDecay hook"), ("grad_clip", 0.0,
                "GradientClipping hook"), ("optimizer_args", "{}", "arguments"))


class ChainerBackend:
    """``pipeline.backends.Backend`` on Chainer 7 (NumPy on CPU, CuPy on a GPU)."""

    name = "chainer"

    def model_names(self) -> tuple[str, ...]:
        from pipeline.backends.chainer.models import MODELS
        from pipeline.backends.chainer.user_models import ZOO
        return (*MODELS, *ZOO)

    def resolve_model(self, name, args, factory, size, n_classes, train=None,
                      optimizer=None):
        from pipeline.backends.chainer import user_models
        from pipeline.backends.chainer.models import MODELS
        if factory is None and name in (*MODELS, *user_models.ZOO) and json.loads(args or "{}"):
            raise UsageError(f"--model-args {args[:80]}: model {name} is built in and takes no "
                             f"arguments (its class count comes from the data); --model-args "
                             f"is for your own pkg.module:factory")
        if factory is None and name in MODELS:
            return name
        if factory is None and name not in user_models.ZOO:
            from pipeline.backends.user import needs_model
            raise needs_model()
        return user_models.check(user_models.make_ref(name, args, factory, size), n_classes,
                                 train=train, optimizer=optimizer)

    def resolve_optimizer(self, factory, train):
        from pipeline.backends.chainer import user_optimizers
        for field, default, theirs in BY_NAME_ONLY:
            if getattr(train, field) != default:
                raise UsageError(f"train.{field} is for an optimizer by name; your optimizer "
                                 f"factory sets its own (Chainer's {theirs}, in the factory)")
        return user_optimizers.check(user_optimizers.make_ref(factory))

    def gpu_report(self) -> tuple[str | None, str]:
        reason = compat.cuda_status(check_device=True)
        return (reason, "") if reason else (None, compat.cuda_summary())

    def check_optimizer(self, train) -> None:
        from pipeline.backends.user import is_import_path
        if is_import_path(train.optimizer):
            return  # the user's factory: resolve_optimizer checks it
        try:
            optimizer = make_optimizer(train.optimizer, train.lr, train.momentum,
                                       train.weight_decay, (train.beta1, train.beta2),
                                       train.adam_eps, train.optimizer_args, train.grad_clip)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except TypeError as exc:
            raise UsageError(f"train.optimizer_args do not fit {train.optimizer}: "
                             f"{one_line(exc, kind=False, limit=200)}") from None
        try:  # an argument of the wrong type ({"momentum": "0.9"}) fails only in an update
            _dry_update(optimizer)
        except Exception as exc:  # noqa: BLE001  whatever the framework raises: one line
            raise UsageError(f"train.optimizer_args {train.optimizer_args} do not fit "
                             f"{train.optimizer}: one update of a small Linear raised "
                             f"{one_line(exc, limit=200)}") from None

    def precision_unavailable(self, precision: str) -> str | None:
        """Why this process cannot run ``precision`` (bf16 runs on oneDNN), else None."""
        from pipeline.backends.chainer.cpu_kernels import dnnl
        if precision == "fp32" or dnnl.load() is not None:
            return None
        return f"--precision {precision} runs on oneDNN, which did not load " \
               f"({dnnl.unavailable_reason()})"

    def check_model(self, model):
        from pipeline.backends.chainer.user_models import ZOO
        from pipeline.backends.user import is_import_path
        if isinstance(model, ModelRef) or model in ZOO or is_import_path(model):
            return model
        if model not in self.model_names():
            raise ValueError(f"model.name must be one of {list(self.model_names())} or "
                             f"pkg.module:factory (your own), got {str(model)[:80]!r}")
        return model

    def to_model(self, model, n_classes: int, params: State):
        stock_kernels.install()  # a model of Chainer's stock links runs our CPU kernels too
        return set_state(build(model, n_classes, blank=True), params)

    def load_weights(self, model, n_classes: int, path: str) -> State:
        return get_state(load_npz(build(model, n_classes, blank=True), path))

    def init_params(self, model, n_classes: int, seed: int) -> State:
        return get_state(build(model, n_classes, seed=seed))

    def train_steps(self, params, opt_state, images, labels, spec, rng):
        _keep_heap_for_training()
        with _mode(True, spec.cpu_kernels):
            model = _model(spec, params)
            optimizer = _optimizer(spec, model, opt_state)
            with _seeded(spec):
                loss_sum, correct, n = _steps(model, optimizer, images, labels, spec, rng)
            return get_state(model), get_optimizer_state(optimizer), StepStats(
                loss_sum, correct, n, bool(np.isfinite(loss_sum)))

    def gradient(self, params, images, labels, spec, rng):
        _keep_heap_for_training()
        with _mode(True, spec.cpu_kernels):
            model = _model(spec, params)
            x, t = _inputs(images, labels, spec)
            with _seeded(spec):
                with _user_code(spec, "forward"):
                    logits = _forward(model, x, spec, rng)
                    loss = F.softmax_cross_entropy(logits, t)
                model.cleargrads()
                with _user_code(spec, "backward"):
                    loss.backward()
            xp = chainer.backend.get_array_module(loss.array)
            tally = xp.stack([loss.array.astype(np.float64) * len(t),
                              (logits.array.argmax(axis=1) == t).sum().astype(np.float64)])
            # BatchNorm statistics as updated by this forward pass, the gradients and the two
            # metrics leave the device together (one transfer per dtype).
            payload = get_state(model, extra={"/tally": tally, **{  # unused: a zero gradient
                path.lstrip("/"): param.grad if param.grad is not None else
                param.xp.zeros_like(param.array) for path, param in model.namedparams()}})
            loss_sum, correct = (float(v) for v in payload.pop("/tally"))
            return payload, StepStats(loss_sum, int(correct), len(t),
                                      bool(np.isfinite(loss_sum)))

    def apply_gradient(self, params, opt_state, gradient, spec):
        model = _model(spec, params)
        optimizer = _optimizer(spec, model, opt_state)
        trainable = set(param_keys(model))
        for path, param in model.namedparams():  # a copy: weight decay adds into the grad
            param.grad = _to_device(np.array(gradient[path.lstrip("/")]), spec.device)
        with _user_code(spec, "update"):
            fused_update.update(optimizer)
        new_params = get_state(model)
        for key, value in gradient.items():  # BatchNorm statistics: the gradient's
            if key not in trainable and np.issubdtype(value.dtype, np.floating):
                new_params[key] = value
        return new_params, get_optimizer_state(optimizer)

    def predict(self, params, images, spec):
        with _mode(False, spec.cpu_kernels), chainer.no_backprop_mode():
            model = _model(spec, params)

            def proba(batch):
                x = augment.normalize(batch, spec.mean, spec.std)
                return F.softmax(_forward(model, x, spec, None)).array

            if len(images) == 0:
                return np.zeros((0, spec.n_classes), np.float32)
            device_images = _to_device(images, spec.device)  # one upload; one download below
            parts = [augment.tta_average(proba, batch) if spec.tta else proba(batch)
                     for batch in (device_images[lo:lo + spec.batch_size]
                                   for lo in range(0, len(images), spec.batch_size))]
            xp = chainer.backend.get_array_module(parts[0])
            return np.asarray(_host(xp.concatenate(parts)), dtype=np.float32)

    def export_onnx(self, params, spec, side, metadata):
        from pipeline.backends import model_label
        from pipeline.backends.chainer import onnx_export
        with _mode(False, "chainer"):
            model = self.to_model(spec.model, spec.n_classes, params)
            return onnx_export.to_onnx(model, lambda x: _forward(model, x, spec, None), side,
                                       spec.mean, spec.std, metadata, model_label(spec.model))

    @contextlib.contextmanager
    def using_threads(self, threads, spec):
        """On a CPU with our kernels, ``threads`` > 1 share each convolution's batch chunks,
        the Linear layers' output pieces, max pooling's images, the element-wise passes'
        slices (ReLU, BatchNorm's normalization, bf16 rounding) and Adam's slices
        (``chainer.config.cpu_kernel_threads``, ``cpu_kernels.sharing``) over one BLAS thread:
        the bits of one thread at any count, where BLAS on n threads splits some products' sums
        and rounds otherwise. Two cores: cifar10-2015 ``single`` 1.37x a one-thread worker in a
        training run, one step 1.43-1.61x (docs/benchmarks.md, "One replica on two threads,
        round two"). Elsewhere BLAS gets the threads."""
        ours = spec.device == "cpu" and spec.cpu_kernels == "ours"
        with limit_blas_threads(1 if ours else threads), \
                chainer.using_config("cpu_kernel_threads", threads if ours else 1), \
                chainer.using_config("cpu_precision", getattr(spec, "precision", "fp32")):
            yield threads


BACKEND = ChainerBackend()
