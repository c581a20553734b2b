"""The augment- stage's kernel: an image's bytes depend on (seed, epoch, position) only, however
the epoch is split among tasks, and the task body gathers a shard from the persisted blocks."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import augment
from pipeline.core.errors import DataError
from pipeline.core.rng import rng_for
from pipeline.data.augment import augment as augment_task
from pipeline.data.augment import augment_positions, augment_rng

SEED, EPOCH, CHUNK = 3, 2, 64
POLICY = augment.get_policy("cifar-cutout")


@pytest.fixture(scope="module")
def raw() -> np.ndarray:
    """(300, 3, 32, 32) uint8, seeded; 300 = 4 full chunks of 64 and one of 44."""
    return np.random.default_rng(0).integers(0, 256, (300, 3, 32, 32), dtype=np.uint8)


@pytest.fixture(scope="module")
def expected(raw) -> np.ndarray:
    """The augmentation of position i = row i, from position-keyed params on the host."""
    params = augment.sample_for_positions(POLICY, augment_rng(SEED, EPOCH), np.arange(len(raw)),
                                          CHUNK)
    return POLICY.apply(raw, params)


def test_any_split_of_the_positions_gives_the_same_bytes(raw, expected):
    order = np.random.default_rng(1).permutation(len(raw))
    for pieces in (1, 3, 7, 300):
        out = np.empty_like(raw)
        for part in np.array_split(order, pieces):
            out[part] = augment_positions(raw[part], part, POLICY, SEED, EPOCH, CHUNK)
        np.testing.assert_array_equal(out, expected)


def test_the_last_short_chunk_uses_the_first_rows_of_its_sample(raw, expected):
    positions = np.arange(256, 300)
    out = augment_positions(raw[256:], positions, POLICY, SEED, EPOCH, CHUNK)
    np.testing.assert_array_equal(out, expected[256:])


def test_epoch_and_seed_change_the_bytes(raw, expected):
    positions = np.arange(len(raw))
    for seed, epoch in ((SEED, EPOCH + 1), (SEED + 1, EPOCH)):
        out = augment_positions(raw, positions, POLICY, seed, epoch, CHUNK)
        assert not np.array_equal(out, expected)


def test_the_task_gathers_its_shard_from_the_blocks(raw, expected):
    labels = np.arange(len(raw), dtype=np.int32) % 10
    starts = (0, 100, 200)
    blocks = [raw[lo:lo + 100] for lo in starts], [labels[lo:lo + 100] for lo in starts]
    indices = np.array([250, 3, 120, 99, 100])  # rows from every block, in the shard's order
    positions = np.array([0, 1, 2, 3, 299])
    shard = augment_task(*blocks, starts, indices, positions, "cifar-cutout", SEED, EPOCH, CHUNK)
    np.testing.assert_array_equal(shard.labels, labels[indices])
    assert shard.labels.dtype == np.int32
    np.testing.assert_array_equal(
        shard.images, augment_positions(raw[indices], positions, POLICY, SEED, EPOCH, CHUNK))


@pytest.mark.parametrize("block", [lambda b: b[:90], lambda b: np.concatenate([b, b[:10]]),
                                   lambda b: b[:, :, :16]], ids=["short", "long", "smaller"])
def test_a_block_unlike_its_declared_rows_is_refused_naming_it(raw, block):
    """A middle block of other rows than its start and the next one's say: a longer one was
    read silently, a short one ended in an IndexError."""
    labels = np.arange(len(raw), dtype=np.int32) % 10
    starts = (0, 100, 200)
    images = [raw[lo:lo + 100] for lo in starts]
    images[1] = block(images[1])
    with pytest.raises(DataError, match=r"training block 1 holds \(\d+, 3, (32|16), (32|16)\) "
                       r"images and 100 labels; rows 100..199 of \(3, 32, 32\) images"):
        augment_task(images, [labels[lo:lo + 100] for lo in starts], starts,
                     np.array([150, 120]), np.array([0, 1]), "cifar-cutout", SEED, EPOCH, CHUNK)


def test_task_functions_and_generators_pickle():
    for obj in (augment_task, augment_positions, augment_rng(SEED, EPOCH), POLICY):
        assert pickle.loads(pickle.dumps(obj)) is not None
    rng = pickle.loads(pickle.dumps(augment_rng(SEED, EPOCH)))(3)
    assert rng.integers(1 << 30) == rng_for(SEED, "augment", EPOCH, 3).integers(1 << 30)
