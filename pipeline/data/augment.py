"""The augment- stage's task body: a replica's shard gathered from the persisted blocks and
augmented, its parameters decided by the images' positions in the epoch's order.

Position p of epoch e draws its parameters from ``rng_for(seed, "augment", e, p // chunk)``
(:func:`augment_rng`; ``augment.chunk`` images per chunk, by global position), the derivation
of ``aug.sample_for_positions``. So the augmented bytes of every image are a function of
(seed, epoch, position) only: one worker or twenty, any split of the epoch among replicas, give
the same result.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

import augment as aug
from pipeline.core.errors import DataError
from pipeline.core.rng import rng_for
from pipeline.data.readers import Shard


def augment_rng(seed: int, epoch: int) -> Callable[[int], np.random.Generator]:
    """``j -> rng_for(seed, "augment", epoch, j)``: the generator of chunk j (picklable).

    >>> g = augment_rng(0, 1)
    >>> bool(g(2).integers(1 << 30) == rng_for(0, "augment", 1, 2).integers(1 << 30))
    True
    """
    return functools.partial(rng_for, seed, "augment", epoch)


def augment_positions(images: np.ndarray, positions: np.ndarray, policy: aug.Compose,
                      seed: int, epoch: int, chunk: int) -> np.ndarray:
    """The kernel: ``images[i]`` sits at ``positions[i]`` of the epoch's order.

    The parameters of position p come from ``rng_for(seed, "augment", epoch, p // chunk)``, so a
    sample's augmentation does not depend on how positions are split among tasks.
    (n, C, H, W) uint8 -> same.
    """
    params = aug.sample_for_positions(policy, augment_rng(seed, epoch), positions, chunk)
    return policy.apply(images, params)


def augment(image_blocks: list, label_blocks: list, starts: tuple, indices: np.ndarray,
            positions: np.ndarray, policy: str, seed: int, epoch: int, chunk: int) -> Shard:
    """Task body of training: gather one replica's shard from the raw blocks and augment it.

    ``indices`` are dataset rows, ``positions`` their places in the epoch's order (see
    ``augment_positions``). Returns uint8 (n, 3, H, W) images and int32 labels.
    """
    first = image_blocks[0]
    images = np.empty((len(indices),) + first.shape[1:], dtype=first.dtype)
    labels = np.empty(len(indices), dtype=np.int32)
    ends = tuple(starts[1:]) + (starts[-1] + len(image_blocks[-1]),)
    for i, (block_images, block_labels, lo, hi) in enumerate(zip(image_blocks, label_blocks,
                                                                 starts, ends)):
        if block_images.shape != (hi - lo,) + first.shape[1:] or len(block_labels) != hi - lo:
            raise DataError(f"training block {i} holds {block_images.shape} images and "
                            f"{len(block_labels)} labels; rows {lo}..{hi - 1} of "
                            f"{first.shape[1:]} images were declared")
        mask = (indices >= lo) & (indices < hi)
        if mask.any():
            images[mask] = block_images[indices[mask] - lo]
            labels[mask] = block_labels[indices[mask] - lo]
    return Shard(augment_positions(images, positions, aug.get_policy(policy), seed, epoch,
                                   chunk), labels)
