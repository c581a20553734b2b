"""One CuPy kernel for a whole optimizer step (Adam, momentum SGD) over flat parameter, gradient and state buffers.

Chainer updates a model one parameter at a time: one kernel per parameter and rule (resnet20:
65 parameters, so 65 launches, 130 with weight decay), each behind a few microseconds of Python.
Here the parameters, and the optimizer's slots, are views of one flat buffer per role, the
gradients are gathered into one (one ``concatenate``), and a single elementwise kernel updates
everything. The per-element arithmetic is the text of Chainer 7.8.1's own kernels
(``MomentumSGDRule``, ``AdamRule``, ``WeightDecay``) with the same float32 scalars, so the numbers
are Chainer's (tests/backends/test_gpu_kernels.py compares the bits).

Anything else (NumPy, other optimizers or hooks, per-parameter hyperparameters, AMSGrad,
AdaBound, loss scaling, a missing gradient) runs ``optimizer.update()``. ``PIPELINE_FUSED_UPDATE=0``
turns it off (worker processes inherit it).
"""
from __future__ import annotations

import os

import numpy as np

from pipeline.backends.chainer.compat import chainer

_KERNELS: dict = {}

# Chainer's kernel bodies (optimizers/momentum_sgd.py, optimizers/adam.py), a weight-decay line
# (optimizer_hooks/weight_decay.py: g += decay * p) in front where the optimizer has that hook.
_DECAY = "grad = grad + decay * param;\n"
_MOMENTUM = """v = momentum * v - lr * grad;
param += v;"""
_ADAM = """T grad_ = static_cast<T>(grad);
T m_ = static_cast<T>(m);
T v_ = static_cast<T>(v);
m_ += one_minus_beta1 * (grad_ - m_);
v_ += one_minus_beta2 * (grad_ * grad_ - v_);
m = static_cast<T>(m_);
v = static_cast<T>(v_);
param -= eta * (alpha_t * m_ / (sqrt(v_) + eps) + weight_decay_rate * param);"""

SPECS = {  # name -> (scalar inputs, state slots, body)
    "momentum": ("T lr, T momentum", ("v",), _MOMENTUM),
    "adam": ("T alpha_t, T one_minus_beta1, T one_minus_beta2, T eps, T eta, "
             "T weight_decay_rate", ("m", "v"), _ADAM),
}


def kernel_source(name: str, decay: bool) -> tuple[str, str, str]:
    """(in params, out params, body) of the fused kernel.

    The gradient array comes first, as in Chainer's kernels, so it fixes ``T`` (float32) for the
    scalars; the body works on a local copy named ``grad``, which weight decay may change.

    >>> ins, outs, body = kernel_source("momentum", decay=True)
    >>> ins, outs
    ('T grad_in, T decay, T lr, T momentum', 'T param, T v')
    >>> body.splitlines()[:2]
    ['T grad = grad_in;', 'grad = grad + decay * param;']
    """
    scalars, slots, body = SPECS[name]
    ins = "T grad_in, " + ("T decay, " if decay else "") + scalars
    outs = ", ".join(["T param"] + [f"T {s}" for s in slots])
    return ins, outs, "T grad = grad_in;\n" + (_DECAY if decay else "") + body


def _kernel(name: str, decay: bool):
    key = (name, decay)
    if key not in _KERNELS:
        import cupy
        _KERNELS[key] = cupy.ElementwiseKernel(*kernel_source(name, decay),
                                               f"pipeline_fused_{name}{'_wd' if decay else ''}")
    return _KERNELS[key]


def enabled() -> bool:
    """``PIPELINE_FUSED_UPDATE`` is not "0"."""
    return os.environ.get("PIPELINE_FUSED_UPDATE", "1") != "0"


def _kind(optimizer) -> str | None:
    """"momentum" | "adam" for a plain MomentumSGD / Adam, else None."""
    if type(optimizer) is chainer.optimizers.MomentumSGD:
        return "momentum"
    if type(optimizer) is chainer.optimizers.Adam:
        hp = optimizer.hyperparam
        if not getattr(hp, "amsgrad", False) and not getattr(hp, "adabound", False):
            return "adam"
    return None


HYPER = {"momentum": ("lr", "momentum"),
         "adam": ("alpha", "beta1", "beta2", "eps", "eta", "weight_decay_rate")}


def _decay_rate(optimizer) -> float | None:
    """The one WeightDecay hook's rate (0.0 for none), None for any other hook."""
    hooks = list(optimizer._hookable._pre_update_hooks.values())
    post = list(optimizer._hookable._post_update_hooks.values())
    if post or len(hooks) > 1:
        return None
    if not hooks:
        return 0.0
    hook = hooks[0]
    return float(hook.rate) if type(hook) is chainer.optimizer_hooks.WeightDecay else None


def plan(optimizer) -> tuple | None:
    """(kind, decay rate, [(param, rule)]) when one fused kernel can update ``optimizer``'s target.

    Every parameter float32 on CuPy with a gradient, every rule enabled with the optimizer's own
    hyperparameters, the same step count and no hooks of its own; no loss scaling.
    """
    from pipeline.backends.chainer.gpu_kernels import is_cupy
    kind = _kind(optimizer)
    decay = _decay_rate(optimizer) if kind else None
    if decay is None or getattr(optimizer, "_loss_scale", None) is not None:
        return None
    pairs = [(p, p.update_rule) for p in optimizer.target.params()]
    if not pairs:
        return None
    ts = set()
    for param, rule in pairs:
        if (rule is None or not rule.enabled or param.array is None or param.grad is None
                or not is_cupy(param.array) or param.array.dtype != np.float32
                or param.grad.dtype != np.float32 or getattr(rule, "_use_fp32_update", False)
                or rule._hookable._pre_update_hooks or rule._hookable._post_update_hooks
                or any(getattr(rule.hyperparam, h) != getattr(optimizer.hyperparam, h)
                       for h in HYPER[kind])):
            return None
        ts.add(rule.t)
    return (kind, decay, pairs) if len(ts) == 1 else None


class Flat:
    """Flat buffers of one optimizer's target: parameters and slots are views of them.

    Built once per optimizer (our tasks make one per task) after :func:`plan` checked it in full;
    each step then only checks what a step can change (:meth:`ready`).
    """

    def __init__(self, kind, decay, pairs):
        import cupy
        self.kind, self.decay, self.pairs = kind, decay, pairs
        sizes = [p.array.size for p, _ in pairs]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.params = cupy.concatenate([p.array.ravel() for p, _ in pairs])
        for param, rule in pairs:
            rule._init_states(param)  # Chainer's own lazy slot creation (zeros) or device move
        self.slots = {}
        for slot in SPECS[kind][1]:
            self.slots[slot] = cupy.concatenate([rule.state[slot].ravel() for _, rule in pairs])
        for (param, rule), lo, hi in zip(pairs, self.offsets[:-1], self.offsets[1:]):
            param.array = self.params[lo:hi].reshape(param.array.shape)
            for slot, flat in self.slots.items():
                rule.state[slot] = flat[lo:hi].reshape(param.array.shape)
        self.bound = self._bound()

    def _bound(self) -> list:
        return [(id(p.array), *(id(r.state[s]) for s in self.slots)) for p, r in self.pairs]

    def ready(self, optimizer) -> bool:
        """True while our views are still the parameters and slots (nothing replaced them),
        every parameter has a float32 gradient, and the rules are enabled and in step."""
        if (_kind(optimizer) != self.kind or _decay_rate(optimizer) != self.decay
                or self._bound() != self.bound):
            return False
        t = self.pairs[0][1].t
        return all(p.grad is not None and p.grad.dtype == np.float32 and r.enabled and r.t == t
                   for p, r in self.pairs)


def _scalars(kind, optimizer, t: int) -> tuple:
    hp = optimizer.hyperparam
    if kind == "momentum":
        return hp.lr, hp.momentum
    import math  # as chainer.optimizers.adam._learning_rate
    fix1, fix2 = 1. - math.pow(hp.beta1, t), 1. - math.pow(hp.beta2, t)
    alpha_t = hp.alpha * math.sqrt(fix2) / fix1
    return alpha_t, 1 - hp.beta1, 1 - hp.beta2, hp.eps, hp.eta, hp.weight_decay_rate


stats = {"fused": 0, "fallback": 0}  # per process, read by benchmarks


def update(optimizer) -> bool:
    """``optimizer.update()`` (no loss function) in one kernel where :func:`plan` allows.

    Returns True when the fused kernel ran, False when Chainer's own update did. Per-rule
    hyperparameters are checked when the flat buffers are built, not every step: our tasks never
    change them after ``setup`` (the learning rate lives on the optimizer).
    """
    flat = getattr(optimizer, "_pipeline_flat", None) if enabled() else None
    if flat is None or not flat.ready(optimizer):
        found = plan(optimizer) if enabled() else None
        if found is None:
            stats["fallback"] += 1
            optimizer.update()
            return False
        flat = optimizer._pipeline_flat = Flat(*found)
    import cupy
    kind, decay, pairs = flat.kind, flat.decay, flat.pairs
    grads = cupy.concatenate([p.grad.ravel() for p, _ in pairs])
    optimizer.t += 1
    for _, rule in pairs:
        rule.t += 1
    scalars = _scalars(kind, optimizer, pairs[0][1].t)
    args = ((decay,) if decay else ()) + scalars
    _kernel(kind, bool(decay))(grads, *args, flat.params, *flat.slots.values())
    stats["fused"] += 1
    return True


__all__ = ["kernel_source", "enabled", "plan", "Flat", "update", "stats", "SPECS"]
