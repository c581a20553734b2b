"""The plan of a run: rounds, shard positions, learning rates."""
import numpy as np
import pytest

from pipeline.core.errors import UsageError
from pipeline.core.schedule import (epoch_permutation, learning_rate, plan_rounds, shard_positions,
                                    steps_per_epoch)

MIX = {"single": "never", "gradient": "every", "mixture": "last", "ipm": "every"}


@pytest.mark.parametrize("strategy", ["single", "gradient", "mixture", "ipm"])
def test_rounds_cover_every_step_once(strategy):
    rounds = plan_rounds(1000, 2, 16, 2.5, 7, MIX[strategy])
    per_epoch = steps_per_epoch(1000, 2, 16)
    steps = [r.global_step + i for r in rounds for i in range(r.steps)]
    assert steps == list(range(round(2.5 * per_epoch)))
    assert all(r.step + r.steps <= per_epoch for r in rounds)  # never straddles an epoch
    assert rounds[-1].epoch_end and rounds[-1].mix == (strategy != "single")


def test_gradient_rounds_are_single_steps():
    assert {r.steps for r in plan_rounds(1000, 2, 16, 1, 1, "every")} == {1}


def test_mixture_mixes_only_at_the_end():
    assert [r.mix for r in plan_rounds(1000, 2, 16, 2, 5, "last")].count(True) == 1


def test_shards_of_replicas_tile_the_global_batch():
    rnd = plan_rounds(1000, 4, 8, 1, 3, "every")[1]
    shards = [shard_positions(rnd, k, 4, 8) for k in range(4)]
    merged = np.sort(np.concatenate(shards))
    start = rnd.step * 4 * 8
    assert np.array_equal(merged, np.arange(start, start + rnd.steps * 4 * 8))


def test_gradient_batches_equal_single_with_k_times_b():
    rnd_g = plan_rounds(1000, 4, 8, 1, 1, "every")[5]
    rnd_s = plan_rounds(1000, 1, 32, 1, 1, "never")[5]
    joined = np.concatenate([shard_positions(rnd_g, k, 4, 8) for k in range(4)])
    assert np.array_equal(joined, shard_positions(rnd_s, 0, 1, 32))


def test_permutation_is_keyed_by_epoch():
    a, b = epoch_permutation(0, 1, 100), epoch_permutation(0, 1, 100)
    assert np.array_equal(a, b) and not np.array_equal(a, epoch_permutation(0, 2, 100))
    assert np.array_equal(np.sort(a), np.arange(100))


def test_batch_larger_than_shard_is_a_usage_error():
    with pytest.raises(UsageError, match="batch_size"):
        steps_per_epoch(100, 4, 32)


def test_warmup_reaches_scaled_rate():
    lrs = [learning_rate(0.1, 4, "linear", 10, s) for s in range(12)]
    assert lrs[0] == pytest.approx(0.1) and lrs[10] == pytest.approx(0.4)
    assert all(a <= b for a, b in zip(lrs, lrs[1:]))
    assert learning_rate(0.1, 4, "none", 0, 3) == 0.1
    assert 0 < learning_rate(0.1, 1, "none", 4, 0) < 0.1


def test_cosine_decay_starts_at_the_warmed_up_peak_and_ends_at_zero():
    total, warm = 100, 10
    lrs = [learning_rate(0.1, 4, "sqrt", warm, s, "cosine", total) for s in range(total + 1)]
    assert lrs[warm] == pytest.approx(0.2) and lrs[total] == pytest.approx(0.0, abs=1e-15)
    assert lrs[warm + 45] == pytest.approx(0.1)  # half-way through the decay: half the peak
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))  # never rises after warmup
    assert lrs[:warm] == [learning_rate(0.1, 4, "sqrt", warm, s) for s in range(warm)]
    assert learning_rate(0.1, 4, "sqrt", warm, 55, "none", total) == pytest.approx(0.2)


def test_the_strategies_train_with_the_decayed_rates():
    from pipeline import Config
    from pipeline.training.strategies.base import Context
    cfg = Config().replace(**{"train.epochs": 2.0, "train.lr": 0.1, "train.lr_decay": "cosine",
                              "train.warmup_epochs": 0.0, "train.lr_scaling": "none"})
    ctx = Context(cfg, 1, 1000, 50, 10, "cpu")
    rounds = plan_rounds(1000, 1, 20, 2.0, 10, "never")
    lrs = [lr for r in rounds for lr in ctx.lrs(r)]
    assert len(lrs) == 100 and lrs[0] == pytest.approx(0.1) and lrs[-1] < 1e-4
    assert lrs[50] == pytest.approx(0.05, rel=0.05)


def test_an_unknown_decay_is_a_usage_error():
    from pipeline import Config
    with pytest.raises(ValueError, match="train.lr_decay"):
        Config().replace(**{"train.lr_decay": "linear"}).validate()
