"""The plan of a run as plain values: rounds, which epoch positions each replica trains on, and learning rates.

Every strategy draws its batches from the same sequence: at epoch ``e`` the training set is
permuted by ``rng_for(seed, "shuffle", e)``, and global step ``s`` of that epoch covers positions
``[s*K*B, (s+1)*K*B)`` of the permutation, replica ``k`` taking the ``k``-th run of ``B``. So
``gradient`` with K replicas of batch B sees exactly the batches of ``single`` with batch K*B, and
``ipm`` with H=1 exactly those of ``gradient``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from pipeline.core.errors import UsageError
from pipeline.core.rng import rng_for


class Round(NamedTuple):
    index: int  # 0-based round number over the whole run
    epoch: int  # epoch this round belongs to (rounds never straddle epochs)
    step: int  # first step of the round within its epoch
    steps: int  # local steps each replica takes in this round
    global_step: int  # first step of the round counted from the start of the run
    mix: bool  # the replicas are averaged (or the gradient applied) at the end of the round
    epoch_end: bool  # last round of its epoch


def steps_per_epoch(n_train: int, replicas: int, batch_size: int) -> int:
    """Full global batches of K*B in one pass (the remainder of the permutation is dropped).

    >>> steps_per_epoch(5000, 4, 64)
    19
    """
    steps = n_train // (replicas * batch_size)
    if steps < 1:
        raise UsageError(
            f"train.batch_size {batch_size} x train.replicas {replicas} = {batch_size * replicas} is "
            f"larger than the {n_train} training images: each replica's shard needs one batch")
    return steps


MIXES = ("every", "last", "never")


MAX_ROUNDS = 1_000_000  # the plan is a list in the driver (~1 s and 200 MB at this size)


def count_rounds(total_steps: int, per_epoch: int, period: int) -> int:
    """Rounds of a plan without building it: rounds never straddle epochs.

    >>> count_rounds(19, 19, 8), count_rounds(10 ** 15, 19, 8)
    (3, 157894736842105)
    """
    full, rest = divmod(total_steps, per_epoch)
    return full * -(-per_epoch // period) + -(-rest // period)


def plan_rounds(n_train: int, replicas: int, batch_size: int, epochs: float, period: int,
                mix: str = "every") -> list[Round]:
    """All rounds of a run: ``period`` local steps each (fewer at an epoch's end); ``mix`` says
    which rounds end in an average (a strategy's choice: every, last or never).

    >>> [r.steps for r in plan_rounds(5000, 4, 64, 1, 8)]
    [8, 8, 3]
    >>> [r.mix for r in plan_rounds(5000, 2, 64, 1, 20, "last")]
    [False, True]
    """
    return continue_plan([], n_train, replicas, batch_size, epochs, period, mix)


def continue_plan(done: list[Round], n_train: int, replicas: int, batch_size: int, epochs: float,
                  period: int, mix: str = "every") -> list[Round]:
    """``done`` (the rounds a run has finished) followed by the rounds that take it to ``epochs``.

    What ``--resume OUT --epochs N`` runs: the finished rounds keep their boundaries, the new
    ones start at the step where they ended. When the old run ended on an epoch boundary this is
    exactly ``plan_rounds`` of the longer run, so the extension equals a run of N epochs.

    >>> short = plan_rounds(5000, 4, 64, 1, 8)
    >>> continue_plan(short, 5000, 4, 64, 2, 8) == plan_rounds(5000, 4, 64, 2, 8)
    True
    >>> [(r.index, r.global_step, r.steps) for r in continue_plan(short[:1], 5000, 4, 64, 0.5, 8)]
    [(0, 0, 8), (1, 8, 2)]
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    per_epoch = steps_per_epoch(n_train, replicas, batch_size)
    total = max(1, int(round(epochs * per_epoch)))
    # the plan is bounded before it is built (an upper bound when resumed rounds come first)
    count = len(done) + count_rounds(total, per_epoch, period)
    if count > MAX_ROUNDS:
        raise UsageError(f"train.epochs {epochs:g} makes {count} rounds of up to {period} step(s); "
                         f"a run is limited to {MAX_ROUNDS} rounds (fewer epochs, or a longer "
                         "--mix-every)")
    rounds = list(done)
    global_step = done[-1].global_step + done[-1].steps if done else 0
    while global_step < total:
        epoch, step = divmod(global_step, per_epoch)
        steps = min(period, per_epoch - step, total - global_step)
        end = global_step + steps
        rounds.append(Round(len(rounds), epoch, step, steps, global_step,
                            mix=mix == "every",
                            epoch_end=end % per_epoch == 0 or end == total))
        global_step = end
    if mix == "last" and len(rounds) > len(done):
        rounds[-1] = rounds[-1]._replace(mix=True)
    return rounds


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the training set in ``epoch``: (n,) int64."""
    return rng_for(seed, "shuffle", epoch).permutation(n)


def shard_positions(rnd: Round, replica: int, replicas: int, batch_size: int) -> np.ndarray:
    """Positions in the epoch's permutation that ``replica`` trains on in ``rnd``, in step order.

    >>> shard_positions(Round(0, 0, 1, 2, 1, True, False), 1, 2, 3).tolist()
    [9, 10, 11, 15, 16, 17]
    """
    starts = (np.arange(rnd.step, rnd.step + rnd.steps) * replicas + replica) * batch_size
    return (starts[:, None] + np.arange(batch_size)).ravel()


def learning_rate(base_lr: float, replicas: int, scaling: str, warmup_steps: int,
                  global_step: int, decay: str = "none", total_steps: int = 0) -> float:
    """Replica learning rate at ``global_step``: ``base_lr`` scaled by K (linear) or sqrt(K),
    reached by a linear warmup over ``warmup_steps`` as in Goyal et al. (2017) and Horovod.

    With scaling the warmup starts from the unscaled ``base_lr``; without it, from zero.
    ``decay`` "cosine" then lowers it along a half cosine to zero at ``total_steps`` (SGDR
    without restarts, Loshchilov & Hutter 2017; see ``decay_factor``).

    >>> learning_rate(0.1, 4, "linear", 0, 0)
    0.4
    >>> learning_rate(0.1, 4, "linear", 10, 5)
    0.25
    >>> learning_rate(0.1, 1, "none", 0, 50, "cosine", 100)
    0.05
    """
    factor = {"none": 1.0, "linear": float(replicas), "sqrt": math.sqrt(replicas)}[scaling]
    target = base_lr * factor
    if warmup_steps <= 0 or global_step >= warmup_steps:
        return target * decay_factor(decay, global_step, warmup_steps, total_steps)
    start = base_lr if factor > 1 else 0.0
    frac = (global_step + 1) / (warmup_steps + 1) if start == 0.0 else global_step / warmup_steps
    return start + (target - start) * frac


def decay_factor(decay: str, global_step: int, warmup_steps: int, total_steps: int) -> float:
    """The share of the peak learning rate left at ``global_step``: 1 for "none"; for "cosine"
    ``(1 + cos(pi * t)) / 2`` with ``t`` the share of the steps after the warmup that are done,
    so the rate falls from the peak at the warmup's end to 0 at ``total_steps``.

    >>> [round(decay_factor("cosine", s, 2, 10), 3) for s in (2, 6, 10)]
    [1.0, 0.5, 0.0]
    """
    if decay == "none":
        return 1.0
    span = total_steps - warmup_steps
    if span <= 0:
        return 1.0
    t = min(max(global_step - warmup_steps, 0) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * t))
