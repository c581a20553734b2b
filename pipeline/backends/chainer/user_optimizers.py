"""The user's optimizer on Chainer: its factory checked on the driver (one update of a small
Linear) and called in each task that steps, as ``OptimizerRef`` values.

The contract (``train(config, optimizer=...)``): a ``chainer.Optimizer`` class, or a Python
function (``user.unfit``) of either form
  - no argument, returning an optimizer the task sets up on the replica's model:
    ``lambda: chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9)``;
  - one argument, the model, returning an optimizer set up on it, hooks added the Chainer way
    (hooks need ``setup`` first):
    ``def opt(link): o = MomentumSGD(lr=0.05); o.setup(link); o.add_hook(WeightDecay(1e-4));
    return o``.
Its learning rate (Adam's kin: alpha) is the run's ``train.lr``: the run's schedule (scaling,
warmup, decay) sets the attribute before every step, as for an optimizer by name. Parameters a
factory froze (``user_models.freeze``) stay frozen whichever form sets the optimizer up.
"""
from __future__ import annotations

import inspect

import numpy as np

from pipeline.backends import OptimizerRef
from pipeline.backends.chainer.compat import F, L, chainer
from pipeline.backends.chainer.state import get_lr
from pipeline.backends.chainer.user_models import _ship, check_factory, timed
from pipeline.backends.user import import_factory, path_of, ship_by_value
from pipeline.core.errors import UsageError, one_line


def make_ref(factory) -> OptimizerRef:
    """An unchecked ``OptimizerRef`` for a callable or an import path the user gave (imported
    now); UsageError, before any call, for what cannot be an optimizer factory."""
    path = factory if isinstance(factory, str) else path_of(factory)
    if isinstance(factory, str):
        factory = import_factory(factory, "--optimizer")
    check_factory(path, factory, chainer.Optimizer, "optimizer ", "a chainer.Optimizer class or "
                  "a Python function returning a chainer.Optimizer")
    takes_link = _takes_link(path, factory)
    ship_by_value(factory)
    return OptimizerRef(path, _ship(path, factory, "optimizer"), takes_link, None)


def _takes_link(path: str, factory) -> bool:
    """Whether the factory takes the model (one required positional parameter) or nothing."""
    if isinstance(factory, type):
        return False  # a class: its constructor's arguments all have defaults (Chainer's do)
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise UsageError(f"optimizer {path} takes {len(required)} arguments; it takes none "
                         f"(returns an optimizer) or the model (returns it set up on the model)")
    return len(required) == 1


def create(ref: OptimizerRef, link):
    """The factory's optimizer, set up on ``link`` (with the hooks the factory added);
    parameters frozen before it stay frozen. UsageError (one line) for what is not one."""
    frozen = [param for param in link.params()
              if param.update_rule is not None and not param.update_rule.enabled]
    try:
        opt = ref.factory(link) if ref.takes_link else ref.factory()
    except (Exception, SystemExit) as exc:
        raise UsageError(f"optimizer {ref.path} raised {one_line(exc, limit=200)}") from None
    if not isinstance(opt, chainer.Optimizer):
        raise UsageError(f"optimizer {ref.path} returned {type(opt).__name__}, not a "
                         f"chainer.Optimizer")
    if not ref.takes_link:
        opt.setup(link)
    elif getattr(opt, "target", None) is not link:
        raise UsageError(f"optimizer {ref.path} returned an optimizer not set up on the model "
                         f"it was given (call opt.setup(link) before returning it)")
    for param in frozen:
        param.update_rule.enabled = False
    return opt


def dry_update(make) -> object:
    """One update of ``make(link)`` (an optimizer set up on it) on a 2 -> 2 Linear on the host;
    returns the optimizer."""
    link = L.Linear(2, 2, initialW=np.eye(2, dtype=np.float32))
    opt = make(link)
    loss = F.sum(link(np.ones((2, 2), np.float32)))
    link.cleargrads()
    loss.backward()
    opt.update()
    return opt


def check(ref: OptimizerRef) -> OptimizerRef:
    """The contract before a cluster starts: the factory gives a ``chainer.Optimizer`` set up
    on a small Linear that takes one update; ``ref`` with the learning rate it gave."""
    rates = []

    def make(link):
        opt = create(ref, link)
        rates.append(get_lr(opt))
        return opt

    with timed(ref.path, what="optimizer"):
        try:
            dry_update(make)
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001  whatever the user's hooks raise: one line
            raise UsageError(f"optimizer {ref.path}: one update of a small Linear raised "
                             f"{one_line(exc, limit=200)}") from None
    return ref._replace(lr=rates[0])
