"""Models the registry does not name: the user's factories and Chainer's own architectures, as
``ModelRef`` values checked on the driver (one dry forward) and built inside tasks.

A factory is a Link class or a Python function returning a ``chainer.Link`` (``check_factory``,
before any call) that maps (N, 3, H, W) float32 to (N, classes) logits. It is imported only when
the user names it (``--model pkg.module:factory``, ``train(config, model=...)``), never because a
run directory's config.json says so. Its randomness is seeded here: initial weights
(initializers and lazily sized parameters draw from NumPy's global RNG) from the run seed's
"init" stream, and everything a training step draws from the global RNGs (``F.dropout``) from the
run seed keyed by (round, replica), under one lock so two tasks in threads of one worker never
interleave their draws.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import random
import sys
import threading

import numpy as np

from pipeline.backends import ModelRef
from pipeline.backends.user import import_factory, path_of, ship_by_value, unfit
from pipeline.backends.chainer.compat import L, chainer
from pipeline.core.errors import UsageError, one_line
from pipeline.core.rng import stream_id

DRY_BATCH = 2  # images in the contract's dry forward
STEP_BATCH = 8  # at most this many images in its training step (the run's batch if smaller)
CHECK_SECONDS = 120.0  # the factory and the contract's steps, together, on the driver
_GLOBAL_RNG = threading.RLock()  # held while a task's steps may draw from the global RNGs


# ---- Chainer's own architectures ---------------------------------------------------------------
# name -> (class in chainer.links, the head replaced for the data's classes, the input side its
# classifier fixes or None). VGG16's fc6 takes 512 x 7 x 7 features and GoogLeNet's pool5 is a
# 7 x 7 average before a 1024-input fc: both need 224 x 224; ResNet-50 pools globally.
ZOO = {"resnet50": ("ResNet50Layers", "fc6", None),
       "vgg16": ("VGG16Layers", "fc8", 224),
       "googlenet": ("GoogLeNet", "loss3_fc", 224)}


class ZooNet(chainer.Chain):
    """One of Chainer's ImageNet architectures with random weights (``pretrained_model=None``:
    nothing is downloaded) and a fresh ``n_classes`` head: (N, 3, H, W) -> (N, n_classes)."""

    def __init__(self, arch: str, n_classes: int = 10):
        super().__init__()
        cls_name, self.head, _ = ZOO[arch]
        with self.init_scope():
            self.net = getattr(L, cls_name)(pretrained_model=None)
            old = getattr(self.net, self.head)
            delattr(self.net, self.head)
            with self.net.init_scope():
                setattr(self.net, self.head, L.Linear(old.W.shape[1], n_classes))

    def forward(self, x):
        return self.net(x, layers=[self.head])[self.head]


# ---- resolving and checking --------------------------------------------------------------------
def _takes_n_classes(factory) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    # named, not swallowed by **kwargs: chainercv2's get_model(name, **kwargs) hands its kwargs
    # to a class that calls it classes=, and fails on n_classes=
    return "n_classes" in params


class Shipped:
    """A factory as it travels to the workers: pickled once on the driver (cloudpickle), and
    unpickled on a worker only after this module (so Chainer's NumPy 2 shims, ``compat``) is
    imported there: a user's module that does ``import chainer`` then works on the workers."""

    def __init__(self, fn, blob: bytes):
        self.fn, self.blob = fn, blob

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return _unship, (self.blob,)


def _unship(blob: bytes) -> Shipped:
    import cloudpickle
    return Shipped(cloudpickle.loads(blob), blob)


def _link_metaclass():
    return type(chainer.Link)


def _dumps(obj) -> bytes:
    """cloudpickle, but Chainer's Link metaclass by reference: it is made inside a function
    (``chainer.utils.meta.enable_final``), so cloudpickle would rebuild a copy of it by value
    and a user's ``Chain`` subclass would fail on a worker with a metaclass conflict."""
    import io

    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if obj is type(chainer.Link):
                return _link_metaclass, ()
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def _ship(path: str, factory, what: str = "model") -> Shipped:
    try:
        return Shipped(factory, _dumps(factory))
    except Exception as exc:
        raise UsageError(f"{what} {path} cannot be sent to the workers: "
                         f"{one_line(exc, limit=200)}") from None


def _token(path: str, shipped: Shipped, args: str, size: tuple) -> str:
    return hashlib.sha256(repr((path, args, size)).encode() + shipped.blob).hexdigest()[:16]


def make_ref(name: str, args: str, factory, size: tuple) -> ModelRef:
    """A ``ModelRef`` for a zoo name, an import path the user gave, or a callable."""
    if factory is None and name in ZOO:
        factory = functools.partial(ZooNet, name)
        path = name
    else:
        path = factory if isinstance(factory, str) else path_of(factory)
        if isinstance(factory, str):
            factory = import_factory(factory)
        if isinstance(factory, chainer.Link):  # a model object stands for its class: each
            factory = type(factory)  # replica builds its own from model.args and the run seed
        check_factory(name, factory)  # the path as the user wrote it (os:system, not posix:)
        ship_by_value(factory)
    size = tuple(int(s) for s in size)
    shipped = _ship(path, factory)
    return ModelRef(path, shipped, args, size, _takes_n_classes(factory),
                    _token(path, shipped, args, size))


def check_factory(path: str, factory, base=None, named: str = "",
                  wanted: str = "a class or Python function returning a chainer.Link") -> None:
    """UsageError, in one line, unless ``factory`` is a subclass of ``base`` (``chainer.Link``)
    or a plain Python function (``user.unfit``), checked before anything calls it: ``model.args``
    come from config.json, so ``os:system`` or ``subprocess:run`` would run them as a command.
    ``named`` prefixes the path in the line ("optimizer "), ``wanted`` says what would do."""
    base = base or chainer.Link
    inner = factory
    while isinstance(inner, functools.partial):
        inner = inner.func
    why = unfit(factory)
    if why is None and isinstance(inner, type) and not issubclass(inner, base):
        why = f"a class that is not a chainer.{base.__name__}"
    if why is not None:
        raise UsageError(f"{named}{path[:120]} is {why}, not {wanted}")


def check(ref: ModelRef, n_classes: int | None, seed: int = 0, train=None,
          optimizer=None) -> ModelRef:
    """The contract, before a cluster starts: the factory returns a ``chainer.Link`` that maps a
    (2, 3, H, W) float32 batch at the data's size to (2, n_classes) (n_classes None: not known
    yet, any class count); with ``train`` (the config's train section) also one step as a task
    takes it (``_dry_step``). UsageError on the first thing that fails, in one line; the whole
    check within ``CHECK_SECONDS`` (``timed``)."""
    fixed = ZOO.get(ref.path, (None, None, None))[2]
    if fixed and ref.size != (fixed, fixed):
        raise UsageError(f"model {ref.path} fixes its input at {fixed}x{fixed} (its classifier's "
                         f"input size); the data's images are {ref.size[0]}x{ref.size[1]} "
                         f"(--image-size {fixed} for image folders, or resnet50)")
    with timed(ref.path):
        link = build(ref, n_classes, seed)
        if train is not None:
            with seeded_globals(seed, "contract"):
                _dry_step(ref, link, n_classes, train, optimizer)
    return ref


def _call(ref: ModelRef, n_classes: int):
    kwargs = json.loads(ref.args)
    if ref.takes_n_classes and n_classes is not None:
        kwargs.setdefault("n_classes", n_classes)
    try:
        link = ref.factory(**kwargs)
    except (Exception, SystemExit) as exc:  # sys.exit() in a factory ended the CLI with 0
        raise UsageError(f"model {ref.path}({', '.join(kwargs)}) raised "
                         f"{one_line(exc, limit=200)}") from None
    if not isinstance(link, chainer.Link):
        raise UsageError(f"model {ref.path} returned {type(link).__name__}, not a chainer.Link")
    return link


def _fits(y, n: int, n_classes: int | None) -> bool:
    shape = getattr(y, "shape", None)
    fits = shape == (n, n_classes) or (n_classes is None and shape is not None
                                       and len(shape) == 2 and shape[0] == n)
    return isinstance(y, (chainer.Variable, np.ndarray)) and fits


def _shape_error(ref: ModelRef, y, n: int, n_classes: int | None, mode: str) -> UsageError:
    shape = getattr(y, "shape", None)
    got = f"shape {shape}" if shape is not None else type(y).__name__
    return UsageError(f"model {ref.path} maps ({n}, 3, {ref.size[0]}, {ref.size[1]}){mode} to "
                      f"{got}, not ({n}, {n_classes or 'classes'}) logits")


def _dry_forward(ref: ModelRef, link, n_classes: int) -> None:
    """One forward of a zero batch at the data's size: materialises lazily sized parameters
    (``in_size=None``) and checks the output is (N, n_classes) logits."""
    x = np.zeros((DRY_BATCH, 3, *ref.size), np.float32)
    try:
        with chainer.using_config("train", False), chainer.no_backprop_mode():
            y = link(x)
    except (Exception, SystemExit) as exc:
        raise UsageError(f"model {ref.path} failed on a (2, 3, {ref.size[0]}, {ref.size[1]}) "
                         f"float32 batch: {one_line(exc, limit=200)}") from None
    if not _fits(y, DRY_BATCH, n_classes):
        raise _shape_error(ref, y, DRY_BATCH, n_classes, "")


def _dry_step(ref: ModelRef, link, n_classes: int | None, train, user_opt=None) -> None:
    """One training step as a task takes it: a training-mode forward of ``min(batch_size,
    STEP_BATCH)`` random images (a model whose BatchNorm, dropout or reshape only breaks in
    training mode, or at a real batch size), the output checked against that batch, a backward
    of the softmax cross-entropy and one update of the configured optimizer with its
    ``optimizer_args`` (an argument of the wrong type fails only there), or of ``user_opt``
    (the user's ``OptimizerRef``, checked already on its own). On ``link``, which is thrown
    away after."""
    from pipeline.backends.chainer.compat import F
    from pipeline.backends.chainer.state import make_optimizer, setup_optimizer
    n = max(1, min(int(train.batch_size), STEP_BATCH))
    x = np.random.default_rng(0).standard_normal((n, 3, *ref.size)).astype(np.float32)
    with chainer.using_config("train", True):
        y = _stage(ref, "forward in training mode", n, lambda: link(x))
        if not _fits(y, n, n_classes):
            raise _shape_error(ref, y, n, n_classes, " in training mode")
        t = (np.arange(n) % y.shape[1]).astype(np.int32)
        loss = _stage(ref, "loss", n, lambda: F.softmax_cross_entropy(y, t))
        link.cleargrads()
        _stage(ref, "backward", n, loss.backward)
    if user_opt is not None:
        from pipeline.backends.chainer.user_optimizers import create
        _stage(ref, f"one update of optimizer {user_opt.path}", n,
               create(user_opt, link).update)
        return
    try:
        optimizer = setup_optimizer(make_optimizer(
            train.optimizer, train.lr, train.momentum, train.weight_decay,
            (train.beta1, train.beta2), train.adam_eps, train.optimizer_args, train.grad_clip),
            link)
    except (ValueError, TypeError):  # check_optimizer's one line says it, before this
        return
    _stage(ref, f"one {train.optimizer} update (optimizer_args {train.optimizer_args})", n,
           optimizer.update)


def _stage(ref: ModelRef, stage: str, n: int, fn):
    try:
        return fn()
    except (Exception, SystemExit) as exc:
        raise UsageError(f"model {ref.path} failed in its {stage} on a ({n}, 3, {ref.size[0]}, "
                         f"{ref.size[1]}) float32 batch: {one_line(exc, limit=200)}") from None


def build(ref: ModelRef, n_classes: int, seed: int | None = None):
    """A fresh Link of ``ref``, its lazily sized parameters materialised at ``ref.size``. ``seed``
    fixes its initial weights (the run's "init" stream); None: a throwaway seed (for Links whose
    weights are loaded right after)."""
    with seeded_globals(seed if seed is not None else 0, "init"):
        link = _call(ref, n_classes)
        _dry_forward(ref, link, n_classes)
    return link


# ---- a time limit on the driver --------------------------------------------------------------
class _TimeUp(BaseException):
    """Raised into the user's code by ``timed``'s alarm: a BaseException, so the user's own
    ``except Exception`` does not swallow it."""


@contextlib.contextmanager
def timed(path: str, seconds: float | None = None, what: str = "model"):
    """UsageError, in one line, when the block (the factory and the contract's steps) runs past
    ``seconds`` (default ``CHECK_SECONDS``). An interval timer (SIGALRM), so only in the main
    thread of the driver (the CLI, a notebook); elsewhere the block runs unbounded. Code that
    never returns to the interpreter (a C loop holding the GIL) is not interrupted. A timer
    already running (pytest-timeout's, the caller's own) keeps its deadline and its handler."""
    import signal
    import time
    seconds = CHECK_SECONDS if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread() or not seconds:
        yield
        return
    outer, interval = signal.getitimer(signal.ITIMER_REAL)
    start, fired = time.monotonic(), []

    def alarm(signum, frame):
        if outer and time.monotonic() - start >= outer - 1e-3 and callable(previous):
            fired.append(True)  # the outer timer's deadline, not ours
            return previous(signum, frame)
        raise _TimeUp()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    except _TimeUp:
        raise UsageError(f"{what} {path} did not build and take one step within {seconds:g} s "
                         f"(the check before a cluster starts; a factory that waits or loops?)"
                         ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer and not fired:
            left = outer - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), interval)


# ---- the global RNGs ------------------------------------------------------------------------
@contextlib.contextmanager
def seeded_globals(seed: int, stream: str, *coords: int):
    """NumPy's and Python's global RNGs (and CuPy's, where it is imported) seeded from
    ``SeedSequence(seed, spawn_key=(stream, *coords))`` for the block, one block at a time per
    process; their previous states come back after it."""
    seq = np.random.SeedSequence(int(seed), spawn_key=(stream_id(stream),
                                                       *(int(c) for c in coords)))
    words = seq.generate_state(4)
    with _GLOBAL_RNG:
        saved_np, saved_py = np.random.get_state(), random.getstate()
        np.random.set_state(np.random.RandomState(np.random.MT19937(seq)).get_state())
        random.seed(int(words[0]) << 32 | int(words[1]))
        cupy = sys.modules.get("cupy")
        if cupy is not None and chainer.backends.cuda.available:
            cupy.random.seed(int(words[2]) << 32 | int(words[3]))
        try:
            yield
        finally:
            np.random.set_state(saved_np)
            random.setstate(saved_py)


def freeze(link) -> None:
    """Mark every parameter of ``link`` frozen: no strategy updates it (call it in a factory).

    Chainer's ``link.disable_update()`` acts on update rules, which only exist once an optimizer
    is set up; a task sets its optimizer up after the factory ran, so this gives each parameter
    a disabled rule that the task's set-up keeps disabled (``state.setup_optimizer``).
    """
    for param in link.params():
        param.update_rule = chainer.UpdateRule()
        param.update_rule.enabled = False
