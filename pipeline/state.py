"""Replica state as values: host NumPy dicts keyed by Chainer paths, moved in and out of Links and optimizers.

``"conv1/W"``, ``"bn1/avg_mean"``, ``"bn1/N"`` for a model (the keys ``save_npz`` writes), and
``"t"``, ``"conv1/W/v"`` for an optimizer. Only these dicts cross task boundaries.
"""
from __future__ import annotations

import threading

import numpy as np

from pipeline.compat import chainer, serializers

State = dict  # dict[str, np.ndarray]


def _host(value) -> np.ndarray:
    return chainer.backend.CpuDevice().send(value)


def get_state(link: chainer.Link) -> State:
    """Parameters and persistent values (BatchNorm statistics) of ``link`` as host arrays (copies)."""
    ser = serializers.DictionarySerializer()
    ser.save(link)
    return {k: np.array(_host(v), copy=True) for k, v in ser.target.items()}


def set_state(link: chainer.Link, state: State) -> chainer.Link:
    """Copy ``state`` into ``link`` in place (on the link's device); every key must be present."""
    serializers.NpzDeserializer(state, strict=True).load(link)
    return link


def get_optimizer_state(optimizer: chainer.Optimizer) -> State:
    """The optimizer's step count and per-parameter slots (momentum ``v``, Adam ``m``/``v``)."""
    ser = serializers.DictionarySerializer()
    ser.save(optimizer)
    return {k: np.array(_host(v), copy=True) for k, v in ser.target.items()}


def set_optimizer_state(optimizer: chainer.Optimizer, state: State) -> None:
    serializers.NpzDeserializer(state, strict=True).load(optimizer)


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
    """A Chainer optimizer by name (sgd | momentum | adam); lr is Adam's alpha."""
    if name == "sgd":
        opt = chainer.optimizers.SGD(lr=lr)
    elif name == "momentum":
        opt = chainer.optimizers.MomentumSGD(lr=lr, momentum=momentum)
    elif name == "adam":
        opt = chainer.optimizers.Adam(alpha=lr)
    else:
        raise ValueError(f"train.optimizer must be one of sgd, momentum, adam, got {name!r}")
    opt.weight_decay_rate_ = weight_decay
    return opt


def setup_optimizer(opt, link):
    opt.setup(link)
    if getattr(opt, "weight_decay_rate_", 0):
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(opt.weight_decay_rate_))
    return opt


def set_lr(optimizer, lr: float) -> None:
    if isinstance(optimizer, chainer.optimizers.Adam):
        optimizer.alpha = lr
    else:
        optimizer.lr = lr


_links = threading.local()


def cached_model(name: str, n_classes: int, device: str = "@numpy") -> chainer.Link:
    """A Link of this architecture for the calling thread, built once per thread and device.

    Its weights are whatever the last task left: callers load a state into it first. Building
    cifar10-2015 draws 5.6 M initial weights (~0.1 s), which a per-task rebuild would repeat.
    """
    from pipeline.models import build_model
    cache = _links.__dict__.setdefault("models", {})
    key = (name, n_classes, device)
    if key not in cache:
        model = build_model(name, n_classes)
        if device != "@numpy":
            model.to_device(device)
        cache[key] = model
    return cache[key]


def param_keys(link: chainer.Link) -> list[str]:
    """Keys of trainable parameters (the others in get_state are persistent statistics)."""
    return [path.lstrip("/") for path, _ in link.namedparams()]


def is_float(array: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(array).dtype, np.floating)
