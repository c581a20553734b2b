"""``augment_array``: the augment- stage mapped over a whole Dask image array, which
benchmarks/augment.py times on LocalClusters of one and two workers (training gathers each
replica's shard in ``pipeline.data.augment.augment`` instead).

Chunk j of the fixed plan [0, chunk), [chunk, 2*chunk), ... is one ``("augment-<token>", epoch,
j)`` task running ``pipeline.data.augment.augment_positions``, so its bytes are the ones training
gives the same positions. The tasks are kept out of Dask's low-level fusion so the dashboard
label survives ``optimize``; a layer of aliases ``("augmented-<token>", j, 0, 0, 0)`` are the
blocks of the returned array.
"""
from __future__ import annotations

import dask.array as da
import numpy as np
from dask._task_spec import Alias, Task, TaskRef
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

import augment as aug
from pipeline.core import keys
from pipeline.data.augment import augment_positions


class AugmentTask(Task):
    """A Task that linear fusion leaves alone (like distributed's P2P barrier), so the
    ``augment-`` key survives ``optimize``."""

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True


def augment_chunk(images: np.ndarray, policy: aug.Compose, seed: int, epoch: int,
                  chunk_index: int, chunk: int) -> np.ndarray:
    """Task body: augment chunk ``chunk_index`` (global positions ``chunk_index*chunk ...``).

    images: (n, C, H, W) uint8 with n <= chunk (the last chunk may be short) -> same.
    """
    start = chunk_index * chunk
    return augment_positions(images, np.arange(start, start + len(images)), policy, seed, epoch,
                             chunk)


def _check_args(images, seed: int, epoch: int, chunk: int) -> None:
    if not isinstance(images, da.Array) or images.ndim != 4 or images.dtype != np.uint8:
        raise ValueError("images must be a dask array of uint8 (N, C, H, W) images, got "
                         f"{type(images).__name__} {getattr(images, 'dtype', '')} "
                         f"{getattr(images, 'shape', '')}")
    if chunk < 1:
        raise ValueError(f"augment.chunk must be >= 1, got {chunk}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")


def augment_array(images: da.Array, policy: aug.Compose, seed: int, epoch: int,
                  chunk: int) -> da.Array:
    """The epoch's augmented images: (N, C, H, W) uint8 dask array -> same, chunks of ``chunk``.

    ``images`` is rechunked to the fixed plan (a no-op when it already has it, e.g. the raw data
    persisted once with that plan); one ``augment-`` task per chunk.
    """
    _check_args(images, seed, epoch, chunk)
    images = images.rechunk({0: chunk, 1: -1, 2: -1, 3: -1})
    token = tokenize(images.name, policy, seed, epoch, chunk)[:8]
    name, out = keys.prefix("augment", token), keys.prefix("augmented", token)
    tasks, aliases = {}, {}
    for j in range(images.numblocks[0]):
        key = keys.make("augment", token, epoch, j)
        tasks[key] = AugmentTask(key, augment_chunk, TaskRef((images.name, j, 0, 0, 0)), policy,
                                 seed, epoch, j, chunk)
        aliases[(out, j, 0, 0, 0)] = Alias((out, j, 0, 0, 0), key)
    layer = HighLevelGraph.from_collections(name, tasks, dependencies=[images])
    graph = HighLevelGraph({**layer.layers, out: aliases}, {**layer.dependencies, out: {name}})
    return da.Array(graph, out, images.chunks, dtype=np.uint8)
