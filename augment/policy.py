"""Augmentation policies: frozen, picklable op descriptions that sample parameters on the host and apply them.

An op is a frozen dataclass with ``sample(rng, n) -> dict`` (NumPy arrays with n rows, drawn
from an explicit ``numpy.random.Generator``) and ``apply(images, params) -> images``. `Compose`
chains ops; its parameters are a tuple with one dict per op. Sampling happens once on the host,
so the same parameters give the same bytes on CPU and GPU, in any process.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from augment import ops as kernels

Params = tuple  # tuple[dict[str, np.ndarray], ...]: one dict per op, every array with N rows


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check(condition: bool, name: str, message: str, value) -> None:
    if not condition:
        raise ValueError(f"{name} {message}, got {value!r}")


@dataclass(frozen=True)
class PadCrop:
    """Pad ``pad`` pixels per side (zeros or reflection), then crop at a uniform random offset."""
    pad: int = 4  # pixels added on each side; the crop moves by up to +-pad
    mode: str = "zero"  # "zero" | "reflect": how the padding is filled

    def __post_init__(self):
        _check(_is_int(self.pad) and self.pad >= 0, "PadCrop.pad", "must be an int >= 0",
               self.pad)
        _check(self.mode in kernels.MODES, "PadCrop.mode", f"must be one of {list(kernels.MODES)}",
               self.mode)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        return {"dy": rng.integers(0, 2 * self.pad + 1, n), "dx": rng.integers(0, 2 * self.pad + 1, n)}

    def shifts(self, params: dict) -> tuple[np.ndarray, np.ndarray]:
        """(sy, sx) of `augment.ops.shift_flip` for these parameters."""
        return params["dy"] - self.pad, params["dx"] - self.pad

    def apply(self, images, params: dict):
        return kernels.pad_crop(images, params["dy"], params["dx"], self.pad, self.mode)


@dataclass(frozen=True)
class Translate:
    """Move the content by a uniform random (ty, tx) in [-max_shift, max_shift], zero fill."""
    max_shift: int = 4  # pixels

    mode = "zero"

    def __post_init__(self):
        _check(_is_int(self.max_shift) and self.max_shift >= 0, "Translate.max_shift",
               "must be an int >= 0", self.max_shift)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        m = self.max_shift
        return {"ty": rng.integers(-m, m + 1, n), "tx": rng.integers(-m, m + 1, n)}

    def shifts(self, params: dict) -> tuple[np.ndarray, np.ndarray]:
        return -params["ty"], -params["tx"]

    def apply(self, images, params: dict):
        return kernels.translate(images, params["ty"], params["tx"])


@dataclass(frozen=True)
class Flip:
    """Mirror left-right with probability ``p``."""
    p: float = 0.5  # probability of a flip per image

    def __post_init__(self):
        _check(0 <= self.p <= 1, "Flip.p", "must be in [0, 1]", self.p)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        return {"flip": rng.random(n) < self.p}

    def apply(self, images, params: dict):
        return kernels.flip(images, params["flip"])


@dataclass(frozen=True)
class Cutout:
    """Zero a ``size`` x ``size`` square at a uniform random centre (DeVries & Taylor 2017)."""
    size: int = 8  # side of the square in pixels; clipped at the image border

    def __post_init__(self):
        _check(_is_int(self.size) and self.size >= 0, "Cutout.size", "must be an int >= 0",
               self.size)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        # Centres as fractions of the image size: the size is only known at apply time.
        return {"cy": rng.random(n), "cx": rng.random(n)}

    def apply(self, images, params: dict):
        h, w = images.shape[2:]
        cy = np.floor(params["cy"] * h).astype(np.int64)
        cx = np.floor(params["cx"] * w).astype(np.int64)
        return kernels.cutout(images, cy, cx, self.size)


@dataclass(frozen=True)
class BrightnessContrast:
    """Scale contrast about the image mean and brightness by uniform factors 1 +- the given widths."""
    brightness: float = 0.2  # brightness factor drawn from [1 - brightness, 1 + brightness]
    contrast: float = 0.2  # contrast factor drawn from [1 - contrast, 1 + contrast]

    def __post_init__(self):
        _check(0 <= self.brightness < 1, "BrightnessContrast.brightness", "must be in [0, 1)",
               self.brightness)
        _check(0 <= self.contrast < 1, "BrightnessContrast.contrast", "must be in [0, 1)",
               self.contrast)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        b, c = self.brightness, self.contrast
        return {"brightness": rng.uniform(1 - b, 1 + b, n), "contrast": rng.uniform(1 - c, 1 + c, n)}

    def apply(self, images, params: dict):
        return kernels.brightness_contrast(images, params["brightness"], params["contrast"])


@dataclass(frozen=True)
class RandomResizedCrop:
    """torchvision's RandomResizedCrop to the input's own size: a box of a uniform share of the
    area in ``scale`` and a log-uniform aspect ratio in ``ratio`` (first of 10 draws that fits,
    else the whole image clamped to the ratio range), at a uniform position, resized bilinearly.

    The default scale keeps at least a quarter of the area: torchvision's 0.08 suits 224-pixel
    crops of full photos, but leaves about 18 pixels of a 64-pixel image.
    """
    scale: tuple = (0.25, 1.0)  # share of the image area the box covers, (min, max)
    ratio: tuple = (3 / 4, 4 / 3)  # box width / height, (min, max)

    attempts = 10  # draws per image before the fallback (torchvision's number)

    def __post_init__(self):
        lo, hi = self.scale
        _check(0 < lo <= hi <= 1, "RandomResizedCrop.scale", "must satisfy 0 < min <= max <= 1",
               self.scale)
        _check(0 < self.ratio[0] <= self.ratio[1], "RandomResizedCrop.ratio",
               "must satisfy 0 < min <= max", self.ratio)

    def sample(self, rng: np.random.Generator, n: int) -> dict:
        # Shares and offsets as fractions: the image size is only known at apply time.
        k = self.attempts
        return {"area": rng.uniform(*self.scale, (n, k)),
                "log_ratio": rng.uniform(*np.log(self.ratio), (n, k)),
                "u": rng.random(n), "v": rng.random(n)}

    def boxes(self, params: dict, h: int, w: int) -> tuple:
        """(top, left, height, width) int arrays of the boxes in an h x w image."""
        area, ratio = params["area"] * h * w, np.exp(params["log_ratio"])
        bw = np.rint(np.sqrt(area * ratio)).astype(np.int64)
        bh = np.rint(np.sqrt(area / ratio)).astype(np.int64)
        fits = (bw >= 1) & (bw <= w) & (bh >= 1) & (bh <= h)
        first = np.argmax(fits, axis=1)
        rows = np.arange(len(first))
        bh, bw = bh[rows, first], bw[rows, first]
        lo, hi = self.ratio
        whole_w, whole_h = (min(w, int(round(h * hi))), h) if w / h > hi else \
            ((w, min(h, int(round(w / lo)))) if w / h < lo else (w, h))
        none = ~fits.any(axis=1)
        bh[none], bw[none] = whole_h, whole_w
        top = np.floor(params["u"] * (h - bh + 1)).astype(np.int64)
        left = np.floor(params["v"] * (w - bw + 1)).astype(np.int64)
        return top, left, bh, bw

    def apply(self, images, params: dict, flip=None):
        h, w = images.shape[2:]
        return kernels.resized_crop(images, *self.boxes(params, h, w), (h, w), flip)


OPS = (PadCrop, Translate, Flip, Cutout, BrightnessContrast, RandomResizedCrop)


@dataclass(frozen=True)
class Compose:
    """A policy: ops applied in order. ``Compose([PadCrop(4), Flip()])``; picklable, hashable.

    >>> policy = Compose([PadCrop(4), Flip()])
    >>> policy
    Compose([PadCrop(pad=4, mode='zero'), Flip(p=0.5)])
    >>> x = np.zeros((5, 3, 8, 8), np.uint8)
    >>> params = policy.sample(np.random.default_rng(0), 5)
    >>> [sorted(p) for p in params], policy.apply(x, params).shape
    ([['dx', 'dy'], ['flip']], (5, 3, 8, 8))
    """
    ops: tuple = ()

    def __init__(self, ops: Sequence = ()):
        ops = tuple(ops)
        for op in ops:
            _check(isinstance(op, OPS), "Compose.ops", f"must hold ops from {[o.__name__ for o in OPS]}",
                   op)
        object.__setattr__(self, "ops", ops)

    def __repr__(self) -> str:
        return f"Compose([{', '.join(map(repr, self.ops))}])"

    def __reduce__(self):
        return Compose, (self.ops,)

    def sample(self, rng: np.random.Generator, n: int) -> Params:
        """Parameters for n images: one dict per op, each array with n rows, drawn in op order."""
        return tuple(op.sample(rng, n) for op in self.ops)

    def apply(self, images, params: Params):
        """(N, C, H, W) uint8 -> same, with the given parameters; a shift op then a Flip run fused."""
        kernels.check_images(images)
        _check(len(params) == len(self.ops), "params", f"must have one dict per op ({len(self.ops)})",
               len(params))
        for part in params:
            for name, values in part.items():
                _check(len(values) == len(images), f"params[{name!r}]",
                       f"must have one row per image ({len(images)})", len(values))
        i = 0
        while i < len(self.ops):
            op = self.ops[i]
            nxt = self.ops[i + 1] if i + 1 < len(self.ops) else None
            if isinstance(op, (PadCrop, Translate)) and isinstance(nxt, Flip):
                sy, sx = op.shifts(params[i])
                images = kernels.shift_flip(images, sy, sx, params[i + 1]["flip"], op.mode)
                i += 2
            elif isinstance(op, RandomResizedCrop) and isinstance(nxt, Flip):
                images = op.apply(images, params[i], params[i + 1]["flip"])  # one gather
                i += 2
            else:
                images = op.apply(images, params[i])
                i += 1
        return images

    def __call__(self, images, rng: np.random.Generator):
        """``apply(images, sample(rng, len(images)))``."""
        return self.apply(images, self.sample(rng, len(images)))


POLICIES = {
    "none": Compose([]),  # identity
    "flip": Compose([Flip()]),
    "cifar": Compose([PadCrop(4), Flip()]),  # the standard CIFAR policy (He et al. 2016)
    "cifar-cutout": Compose([PadCrop(4), Flip(), Cutout(8)]),  # + cutout 8 px (DeVries 2017)
    # image folders: torchvision's ImageNet training transform at the decoded size
    "resized-crop": Compose([RandomResizedCrop(), Flip()]),
}


def get_policy(name: str) -> Compose:
    """The policy registered under ``name`` in POLICIES.

    >>> get_policy("cifar")
    Compose([PadCrop(pad=4, mode='zero'), Flip(p=0.5)])
    >>> get_policy("x")
    Traceback (most recent call last):
    ...
    ValueError: augment.policy must be one of ['none', 'flip', 'cifar', 'cifar-cutout', 'resized-crop'], got 'x'
    """
    if name not in POLICIES:
        raise ValueError(f"augment.policy must be one of {list(POLICIES)}, got {name!r}")
    return POLICIES[name]


def take_params(params: Params, index) -> Params:
    """The rows ``index`` (int array, bool mask or slice) of every parameter array.

    >>> take_params(({"a": np.arange(4)},), [3, 0])
    ({'a': array([3, 0])},)
    """
    return tuple({name: np.asarray(values)[index] for name, values in part.items()} for part in params)


def concat_params(parts: Sequence[Params]) -> Params:
    """Stack parameter sets row-wise (all from the same policy)."""
    return tuple({name: np.concatenate([p[i][name] for p in parts]) for name in parts[0][i]}
                 for i in range(len(parts[0])))


def sample_for_positions(policy: Compose, rng_for_chunk: Callable[[int], np.random.Generator],
                         positions: np.ndarray, chunk: int) -> Params:
    """Parameters for arbitrary global positions of an epoch, one row per position.

    Position p gets row ``p % chunk`` of ``policy.sample(rng_for_chunk(p // chunk), chunk)``: the
    augmentation of p depends on (the chunk's generator, p) only, not on how positions are split
    among replicas, rounds or workers. positions: (M,) non-negative ints -> params with M rows.

    >>> rngs = lambda j: np.random.default_rng(j)
    >>> a = sample_for_positions(get_policy("cifar"), rngs, np.arange(10), 4)
    >>> b = sample_for_positions(get_policy("cifar"), rngs, np.array([7, 2]), 4)
    >>> bool((a[0]["dy"][[7, 2]] == b[0]["dy"]).all())
    True
    """
    _check(chunk >= 1, "chunk", "must be >= 1", chunk)
    positions = np.asarray(positions, np.int64).reshape(-1)
    _check(positions.size == 0 or positions.min() >= 0, "positions", "must be >= 0",
           positions.min() if positions.size else None)
    chunks, inverse = np.unique(positions // chunk, return_inverse=True)
    if len(chunks) == 0:
        return policy.sample(np.random.default_rng(0), 0)
    table = concat_params([policy.sample(rng_for_chunk(int(j)), chunk) for j in chunks])
    return take_params(table, inverse.reshape(-1) * chunk + positions % chunk)
