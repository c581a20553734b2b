"""One CuPy kernel for a whole optimizer step (Adam, momentum SGD) over every parameter, gradient and slot.

Chainer updates a model one parameter at a time: one kernel per parameter and rule (resnet20:
65 parameters, so 65 launches, 130 with weight decay), each behind tens of microseconds of
Python. Here one elementwise kernel runs over all elements of all parameters: each thread finds
its parameter in a table of cumulative sizes and reaches the parameter, its gradient and its
slots through tables of device pointers (as CuPy's own ``concatenate`` kernel does). The
parameter and slot tables are built once per optimizer; the gradient table (fresh arrays every
step) is one small upload a step. Nothing is copied or re-laid out: the arrays stay Chainer's.
The per-element arithmetic is the text of Chainer 7.8.1's own kernels (``MomentumSGDRule``,
``AdamRule``, ``WeightDecay``) on the same float32 scalars, so the numbers are Chainer's
(tests/backends/test_gpu_cudnn.py compares the bits).

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
    "momentum": (("lr", "momentum"), ("v",), _MOMENTUM),
    "adam": (("alpha_t", "one_minus_beta1", "one_minus_beta2", "eps", "eta",
              "weight_decay_rate"), ("m", "v"), _ADAM),
}

# Element i of the concatenation of all parameters: binary search of the cumulative sizes
# (cum[j] <= i < cum[j + 1]), then references into parameter j and its gradient and slots.
_FIND = """ptrdiff_t lo_ = 0, hi_ = cum.size() - 1;
while (hi_ - lo_ > 1) {
  ptrdiff_t mid_ = (lo_ + hi_) / 2;
  if (i < cum[mid_]) hi_ = mid_; else lo_ = mid_;
}
const ptrdiff_t k_ = i - cum[lo_];
const T grad_in = reinterpret_cast<const T*>(grad_ptrs[lo_])[k_];
T& param = reinterpret_cast<T*>(param_ptrs[lo_])[k_];
"""


def kernel_source(name: str, decay: bool) -> tuple[str, str, str]:
    """(in params, out params, body) of the fused kernel (``T`` is float32, from the preamble).

    >>> ins, outs, body = kernel_source("momentum", decay=True)
    >>> ins
    'raw int64 grad_ptrs, raw int64 cum, float32 decay, float32 lr, float32 momentum, raw int64 v_ptrs'
    >>> outs
    'raw int64 param_ptrs'
    >>> body.splitlines()[-4:-2]
    ['T grad = grad_in;', 'grad = grad + decay * param;']
    """
    scalars, slots, body = SPECS[name]
    names = (("decay",) if decay else ()) + scalars
    ins = ", ".join(["raw int64 grad_ptrs", "raw int64 cum"] + [f"float32 {n}" for n in names]
                    + [f"raw int64 {s}_ptrs" for s in slots])
    refs = "".join(f"T& {s} = reinterpret_cast<T*>({s}_ptrs[lo_])[k_];\n" for s in slots)
    return (ins, "raw int64 param_ptrs",
            _FIND + refs + "T grad = grad_in;\n" + (_DECAY if decay else "") + body)


def _kernel(name: str, decay: bool):
    key = (name, decay)
    if key not in _KERNELS:
        import cupy
        _KERNELS[key] = cupy.ElementwiseKernel(
            *kernel_source(name, decay), f"pipeline_fused_{name}{'_wd' if decay else ''}",
            preamble="typedef float T;")
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


def _pointers(arrays) -> np.ndarray:
    """Data addresses (CuPy: device pointers; NumPy, in tests: host addresses) as int64."""
    return np.fromiter((a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data
                        for a in arrays), np.int64, len(arrays))


class Tables:
    """Device tables of one optimizer's target: cumulative sizes, parameter and slot pointers.

    Built once per optimizer (our tasks make one per task) after :func:`plan` checked it in full;
    each step then only checks what a step can change (:meth:`ready`).
    """

    def __init__(self, kind, decay, pairs):
        import cupy
        self.kind, self.decay, self.pairs = kind, decay, pairs
        for param, rule in pairs:
            rule._init_states(param)  # Chainer's own lazy slot creation (zeros) or device move
        self.slot_names = SPECS[kind][1]
        for _, rule in pairs:  # loaded slots are views of one upload: contiguous already
            for slot in self.slot_names:
                if not rule.state[slot].flags.c_contiguous:
                    rule.state[slot] = cupy.ascontiguousarray(rule.state[slot])
        sizes = [p.array.size for p, _ in pairs]
        self.total = int(sum(sizes))
        self.cum = cupy.asarray(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        self.param_ptrs = cupy.asarray(_pointers([p.array for p, _ in pairs]))
        self.slot_ptrs = [cupy.asarray(_pointers([r.state[s] for _, r in pairs]))
                          for s in self.slot_names]
        self.bound = self._bound()

    def _bound(self) -> list:
        return [(id(p.array), *(id(r.state[s]) for s in self.slot_names)) for p, r in self.pairs]

    def ready(self, optimizer) -> bool:
        """True while the tables still point at the parameters and slots (nothing replaced an
        array), every parameter has a C-contiguous float32 gradient, and the rules are enabled
        and in step."""
        if (_kind(optimizer) != self.kind or _decay_rate(optimizer) != self.decay
                or self._bound() != self.bound):
            return False
        t = self.pairs[0][1].t
        for p, r in self.pairs:
            g = p.grad
            if (g is None or g.dtype != np.float32 or not g.flags.c_contiguous
                    or not r.enabled or r.t != t):
                return False
        return True


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
    hyperparameters are checked when the pointer tables are built, not every step: our tasks never
    change them after ``setup`` (the learning rate lives on the optimizer).
    """
    tables = getattr(optimizer, "_pipeline_tables", None) if enabled() else None
    if tables is None or not tables.ready(optimizer):
        found = plan(optimizer) if enabled() else None
        if found is None or not _grads_ok(found[2]):
            stats["fallback"] += 1
            optimizer.update()
            return False
        tables = optimizer._pipeline_tables = Tables(*found)
    import cupy
    kind, decay, pairs = tables.kind, tables.decay, tables.pairs
    grad_ptrs = cupy.asarray(_pointers([p.grad for p, _ in pairs]))  # one small upload a step
    optimizer.t += 1
    for _, rule in pairs:
        rule.t += 1
    scalars = _scalars(kind, optimizer, pairs[0][1].t)
    args = ((decay,) if decay else ()) + scalars
    _kernel(kind, bool(decay))(grad_ptrs, tables.cum, *args, *tables.slot_ptrs,
                               tables.param_ptrs, size=tables.total)
    stats["fused"] += 1
    return True


def _grads_ok(pairs) -> bool:
    return all(p.grad.flags.c_contiguous and p.array.flags.c_contiguous for p, _ in pairs)


__all__ = ["kernel_source", "enabled", "plan", "Tables", "update", "stats", "SPECS"]
