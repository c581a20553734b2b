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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def counter_uniform(xp, key: int, shape: tuple):
    """float32 uniforms in [0, 1) of ``shape``, computed where ``xp`` (numpy or cupy) computes.

    Element i is splitmix64(key + (i + 1) * golden) >> 40, scaled by 2**-24: plain uint64
    arithmetic, so NumPy and CuPy give the same bits, and a GPU task draws its dropout mask on the
    device instead of drawing it on the host and copying it up. ``key`` comes from a seeded
    generator (``rng_for(...).integers(2**63)``), so the stream is still keyed by the task.

    >>> u = counter_uniform(np, 7, (2, 3))
    >>> u.dtype, u.shape, bool(((0 <= u) & (u < 1)).all())
    (dtype('float32'), (2, 3), True)
    >>> bool((u == counter_uniform(np, 7, (2, 3))).all()), bool((u != counter_uniform(np, 8, (2, 3))).any())
    (True, True)
    """
    n = int(np.prod(shape, dtype=np.int64))
    z = xp.arange(1, n + 1, dtype=xp.uint64)
    z *= _GOLDEN
    z += np.uint64(int(key) % (1 << 64))
    for shift, mix in ((30, _MIX1), (27, _MIX2)):  # in place: 8 bytes an element, no temporaries
        z ^= z >> np.uint64(shift)
        z *= mix
    z ^= z >> np.uint64(31)
    z >>= np.uint64(40)
    u = z.astype(xp.float32)
    u *= np.float32(2.0 ** -24)
    return u.reshape(shape)
