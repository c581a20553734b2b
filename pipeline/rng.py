"""Every random stream of a run, derived from the run seed and the coordinates of the task that uses it."""
from __future__ import annotations

import zlib

import numpy as np

# Streams are named for readability and hashed to a stable integer (crc32 is stable across
# processes and Python versions, unlike hash()).
STREAMS = ("init", "shuffle", "augment", "dropout", "synthetic", "evaluate")


def stream_id(stream: str) -> int:
    """Stable integer for a stream name.

    >>> stream_id("augment") == stream_id("augment")
    True
    """
    return zlib.crc32(stream.encode())


def rng_for(seed: int, stream: str, *coords: int) -> np.random.Generator:
    """Generator for one (stream, coordinates) of the run seeded by ``seed``.

    The coordinates are the ones in the task key, e.g. ``rng_for(seed, "augment", epoch, chunk)``,
    so the numbers drawn never depend on which worker runs the task.

    >>> a = rng_for(0, "shuffle", 3).integers(1 << 30)
    >>> b = rng_for(0, "shuffle", 3).integers(1 << 30)
    >>> bool(a == b), bool(a == rng_for(0, "shuffle", 4).integers(1 << 30))
    (True, False)
    """
    key = (stream_id(stream), *(int(c) for c in coords))
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=key)))


def legacy_state_for(seed: int, stream: str, *coords: int) -> np.random.RandomState:
    """A ``RandomState`` (what Chainer's initializers take) from the same derivation as rng_for."""
    seq = np.random.SeedSequence(int(seed), spawn_key=(stream_id(stream), *(int(c) for c in coords)))
    return np.random.RandomState(np.random.MT19937(seq))
