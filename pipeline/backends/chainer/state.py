"""Replica state as values: host NumPy dicts keyed by Chainer paths, moved in and out of Links and optimizers.

``"conv1/W"``, ``"bn1/avg_mean"``, ``"bn1/N"`` for a model (the keys ``save_npz`` writes), and
``"t"``, ``"conv1/W/v"`` for an optimizer. Only these dicts cross task boundaries.
"""
from __future__ import annotations

import threading

import numpy as np

from pipeline.backends.chainer.compat import chainer, serializers

State = dict  # dict[str, np.ndarray]


def _host(value) -> np.ndarray:
    return chainer.backend.CpuDevice().send(value)


class _Collect(chainer.serializer.Serializer):
    """Records what a Link or optimizer serializes, as it is: device arrays stay on the device."""

    def __init__(self, target: dict | None = None, path: str = ""):
        self.target = {} if target is None else target
        self.path = path

    def __getitem__(self, key):
        return _Collect(self.target, self.path + key.strip("/") + "/")

    def __call__(self, key, value):  # the keys DictionarySerializer would write
        self.target[self.path + key.lstrip("/")] = value
        return value


def _is_device_array(value) -> bool:
    return not isinstance(value, np.ndarray) and hasattr(value, "__cuda_array_interface__")


def _to_host(values: dict) -> State:
    """Serialized values -> host copies; device arrays move in one transfer per dtype.

    A Link on a GPU holds dozens of arrays (resnet20: 65, its Adam state 130); copying them one by
    one costs a synchronising cudaMemcpy each. Packing them into one flat buffer per dtype on the
    device makes the round trip one copy.
    """
    out, groups = {}, {}
    for key, value in values.items():
        if _is_device_array(value):
            groups.setdefault(value.dtype, []).append(key)
        else:
            out[key] = np.array(_host(value) if value is not None else np.asarray(None), copy=True)
    for dtype, keys in groups.items():
        xp = chainer.backend.get_array_module(values[keys[0]])
        flat = xp.concatenate([values[k].ravel() for k in keys]).get()
        offset = 0
        for k in keys:
            size = values[k].size
            out[k] = flat[offset:offset + size].reshape(values[k].shape)
            offset += size
    return {k: out[k] for k in values}  # serialization order, as DictionarySerializer gives it


class _DeviceDeserializer(serializers.NpzDeserializer):
    """NpzDeserializer whose source arrays may already be on the target's device (no host copy)."""

    def __getitem__(self, key):
        return _DeviceDeserializer(self.npz, self.path + key.strip("/") + "/", strict=self.strict,
                                   ignore_names=self.ignore_names)

    def __call__(self, key, value):
        source = self.npz.get(self.path + key.lstrip("/"))
        if _is_device_array(value) and _is_device_array(source):
            value[...] = source
            return value
        return super().__call__(key, value)


def _upload(state: State, like) -> dict:
    """Host float/int arrays -> views of one device buffer per dtype, on ``like``'s device."""
    xp = chainer.backend.get_array_module(like)
    out, groups = dict(state), {}
    for key, value in state.items():
        value = np.asarray(value)
        if value.dtype.kind in "fiub" and value.ndim > 0:
            groups.setdefault(value.dtype, []).append(key)
    for dtype, keys in groups.items():
        flat = xp.asarray(np.concatenate([np.asarray(state[k]).ravel() for k in keys]))
        offset = 0
        for k in keys:
            shape = np.shape(state[k])
            size = int(np.prod(shape))
            out[k] = flat[offset:offset + size].reshape(shape)
            offset += size
    return out


def _device_sample(link) -> object | None:
    for param in link.params():
        if _is_device_array(param.array):
            return param.array
    return None


def get_state(link: chainer.Link, extra: dict | None = None) -> State:
    """Parameters and persistent values (BatchNorm statistics) of ``link`` as host arrays (copies).

    ``extra`` arrays (e.g. gradients, on the link's device) come back in the same transfer.
    """
    ser = _Collect()
    ser.save(link)
    return _to_host({**ser.target, **(extra or {})})


class _PrivateDeserializer(serializers.NpzDeserializer):
    """Chainer's deserializer, but never handing out the caller's arrays.

    Chainer's adopts an array wherever its target is still None (an optimizer's lazily created
    slots, an uninitialized parameter) and the optimizer then updates it in place: a task would
    change its own inputs (and fail on read-only ones). Where a target exists it copies into it
    anyway, so only the adopted arrays are copied here.
    """

    def __getitem__(self, key):
        return _PrivateDeserializer(self.npz, self.path + key.strip("/") + "/",
                                    strict=self.strict, ignore_names=self.ignore_names)

    def __call__(self, key, value):
        out = super().__call__(key, value)
        return np.array(out, copy=True) if value is None and isinstance(out, np.ndarray) else out


def set_state(link: chainer.Link, state: State) -> chainer.Link:
    """Copy ``state`` into ``link`` in place (on the link's device); every key must be present.

    On a GPU the state goes up in one transfer per dtype, then device-to-device into the Link.
    ``state`` itself is never written to or adopted.
    """
    sample = _device_sample(link)
    if sample is None:
        _PrivateDeserializer(state, strict=True).load(link)
    else:
        _DeviceDeserializer(_upload(state, sample), strict=True).load(link)
    return link


def load_npz(link: chainer.Link, path: str) -> chainer.Link:
    """Load the weights file ``path`` (a ``model.npz``) into ``link`` with our own reader.

    Never unpickles (Chainer's ``serializers.load_npz`` would): names, shapes and dtypes must be
    exactly the link's, checked before any data is read. Raises ``npz.Mismatch`` when they are
    not, ``DataError`` when the file is not a readable ``.npz``.
    """
    from pipeline.core import npz
    return set_state(link, npz.read(path, npz.specs_of(get_state(link))))


def get_optimizer_state(optimizer: chainer.Optimizer) -> State:
    """The optimizer's step count and per-parameter slots (momentum ``v``, Adam ``m``/``v``)."""
    ser = _Collect()
    ser.save(optimizer)
    return _to_host(ser.target)


def set_optimizer_state(optimizer: chainer.Optimizer, state: State) -> None:
    """Load ``state`` into ``optimizer`` (after ``setup``); ``state`` itself is never adopted."""
    sample = _device_sample(optimizer.target)
    if sample is None:
        _PrivateDeserializer(state, strict=True).load(optimizer)
    else:  # fresh device views: slots the optimizer adopts are its own, never the task's input
        _DeviceDeserializer(_upload(state, sample), strict=True).load(optimizer)


LEGACY_OPTIMIZERS = ("sgd", "momentum", "adam")


def _optimizer_class(name: str):
    """The class of ``chainer.optimizers`` called ``name`` (sgd, momentum, adam: SGD,
    MomentumSGD, Adam), or ValueError naming the field."""
    cls = getattr(chainer.optimizers, {"sgd": "SGD", "momentum": "MomentumSGD",
                                       "adam": "Adam"}.get(name, name), None)
    if not (isinstance(cls, type) and issubclass(cls, chainer.Optimizer)):
        raise ValueError(f"train.optimizer must be one of {', '.join(LEGACY_OPTIMIZERS)} or a "
                         f"class of chainer.optimizers, got {name!r}")
    return cls


def _alpha_is_lr(cls) -> bool:
    """Adam and its kin (AdamW, AMSGrad, AdaBound, AMSBound) call their learning rate alpha."""
    return issubclass(cls, chainer.optimizers.Adam)


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                   betas: tuple = (0.9, 0.999), eps: float = 1e-8, args: str = "{}",
                   grad_clip: float = 0.0):
    """A Chainer optimizer by name: sgd | momentum | adam (``momentum``, ``betas`` and ``eps``
    are theirs) or any class of ``chainer.optimizers`` with ``args`` (JSON keyword arguments).
    ``lr`` is the learning rate (Adam's alpha); ``weight_decay`` and ``grad_clip`` become
    Chainer's WeightDecay and GradientClipping hooks at set-up. TypeError for arguments the
    class does not take."""
    import json
    cls = _optimizer_class(name)
    kwargs = json.loads(args)
    taken = "alpha" if _alpha_is_lr(cls) else "lr"
    if taken in kwargs:
        raise ValueError(f"train.optimizer_args: the learning rate is --lr (train.lr), not "
                         f"{taken!r} in the arguments")
    if name == "momentum":
        kwargs.setdefault("momentum", momentum)
    elif cls is chainer.optimizers.Adam and name == "adam":
        kwargs.setdefault("beta1", betas[0])
        kwargs.setdefault("beta2", betas[1])
        kwargs.setdefault("eps", eps)
    opt = cls(**kwargs)
    set_lr(opt, lr)
    opt.weight_decay_rate_ = weight_decay
    opt.grad_clip_ = grad_clip
    return opt


def setup_optimizer(opt, link):
    """``opt.setup(link)`` with its hooks; parameters whose update rule was disabled before
    (``user_models.freeze``, or a task's cached Link frozen earlier) stay disabled."""
    frozen = [param for param in link.params()
              if param.update_rule is not None and not param.update_rule.enabled]
    opt.setup(link)
    for param in frozen:
        param.update_rule.enabled = False
    if getattr(opt, "weight_decay_rate_", 0):
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(opt.weight_decay_rate_))
    if getattr(opt, "grad_clip_", 0):
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(opt.grad_clip_))
    return opt


def set_lr(optimizer, lr: float) -> None:
    """The learning rate of the next step (Adam's kin: alpha; AdaDelta has none)."""
    if _alpha_is_lr(type(optimizer)):
        optimizer.alpha = lr
    elif "lr" in optimizer.hyperparam.get_dict():
        optimizer.lr = lr


def get_lr(optimizer) -> float | None:
    """The learning rate ``set_lr`` sets (Adam's kin: alpha); None for an optimizer without."""
    if _alpha_is_lr(type(optimizer)):
        return float(optimizer.alpha)
    hyper = optimizer.hyperparam.get_dict()
    return float(hyper["lr"]) if "lr" in hyper else None


_links = threading.local()


def build(model, n_classes: int, seed: int | None = None, blank: bool = False) -> chainer.Link:
    """A fresh Link of a registry name or a ``ModelRef`` (``user_models``). ``blank``: its
    weights are all loaded next, so a registry model draws none (a user's factory is called
    unchanged: its initializers are its own)."""
    if isinstance(model, str):
        from pipeline.backends.chainer.models import build_model
        return build_model(model, n_classes, seed=seed, blank=blank)
    from pipeline.backends.chainer import user_models
    return user_models.build(model, n_classes, seed)


def cached_model(name, n_classes: int, device: str = "@numpy") -> chainer.Link:
    """A Link of this architecture (a registry name or a ``ModelRef``) for the calling thread,
    built once per thread and device.

    Its weights are whatever the last task left: callers load a state into it first. Building
    one per task would cost ~10 ms for cifar10-2015 even undrawn (``blank``).
    A ``ModelRef``'s factory arrives unpickled afresh with each task: its token is the key.
    """
    cache = _links.__dict__.setdefault("models", {})
    key = (name if isinstance(name, str) else name.token, n_classes, device)
    if key not in cache:
        model = build(name, n_classes, blank=True)
        if device != "@numpy":
            model.to_device(device)
        cache[key] = model
    return cache[key]


def param_keys(link: chainer.Link) -> list[str]:
    """Keys of trainable parameters (the others in get_state are persistent statistics)."""
    return [path.lstrip("/") for path, _ in link.namedparams()]
