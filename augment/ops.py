"""Vectorized augmentation kernels: pure functions of a whole (N, C, H, W) uint8 batch and its parameters.

Every kernel takes parameters already sampled on the host (NumPy arrays with one row per image)
and applies them with the array module of the images (NumPy or CuPy, `augment.xp`), so CPU and
GPU give byte-identical results. None of them loops over images in Python.

Geometric ops share one kernel, `shift_flip`: ``out[n] = flip_n(shift_n(images[n]))`` with
``shift(img)[c, y, x] = img[c, y + sy, x + sx]`` and the outside filled with zeros or by
reflection. On NumPy, zero fill gathers blocks of images already shifted from a sliding-window
view of the flat batch (`_shift_flip_zero_numpy`) and reflect fill loops over the few distinct
(sy, sx, flip) groups; on CuPy it is one index gather (`shift_flip_gather`), which the tests
hold byte-equal to the NumPy paths.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from augment.xp import array_module

MODES = ("zero", "reflect")

# CIFAR-10 training-set channel statistics in uint8 units (0..255): 255 x (0.4914, 0.4822, 0.4465)
# and 255 x (0.2470, 0.2435, 0.2616), the per-pixel standard deviation over the 50,000 images.
CIFAR10_MEAN = (125.307, 122.961, 113.8575)
CIFAR10_STD = (62.9925, 62.0925, 66.708)


def check_images(images, name: str = "images") -> None:
    """Raise ValueError unless ``images`` is a (N, C, H, W) uint8 array.

    >>> check_images(np.zeros((2, 3, 4, 4), np.float32))
    Traceback (most recent call last):
    ...
    ValueError: images must be a uint8 array of shape (N, C, H, W), got float32 (2, 3, 4, 4)
    """
    if getattr(images, "ndim", None) != 4 or images.dtype != np.uint8:
        raise ValueError(f"{name} must be a uint8 array of shape (N, C, H, W), got "
                         f"{getattr(images, 'dtype', type(images).__name__)} "
                         f"{tuple(getattr(images, 'shape', ()))}")


def _host_rows(values, n: int, name: str, dtype) -> np.ndarray:
    """Per-image parameter -> host array of shape (n,) and ``dtype``; ValueError naming it otherwise."""
    values = np.asarray(values)
    if values.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) (one value per image), got {values.shape}")
    return values.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# geometric ops


def shift_flip(images, sy, sx, flip=None, mode: str = "zero"):
    """Shift each image by (sy, sx) pixels, then mirror it left-right where ``flip``.

    ``out[n, c, y, x] = images[n, c, y + sy[n], x' + sx[n]]`` with ``x' = W-1-x`` if flip[n] else x;
    outside the image the value is 0 (``mode="zero"``) or the reflection across the border
    (``mode="reflect"``, NumPy's ``np.pad`` reflect; needs |shift| < size).

    images: (N, C, H, W) uint8 (NumPy or CuPy); sy, sx: (N,) ints; flip: (N,) bool or None.
    Returns (N, C, H, W) uint8 with the array module of ``images``.

    >>> x = np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4)
    >>> shift_flip(x, [0], [1])[0, 0, 0].tolist(), shift_flip(x, [0], [1], [True])[0, 0, 0].tolist()
    ([1, 2, 3, 0], [0, 3, 2, 1])
    """
    check_images(images)
    n, _, h, w = images.shape
    sy, sx = _host_rows(sy, n, "sy", np.int64), _host_rows(sx, n, "sx", np.int64)
    flip = np.zeros(n, bool) if flip is None else _host_rows(flip, n, "flip", bool)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "reflect" and n and (np.abs(sy).max() >= h or np.abs(sx).max() >= w):
        raise ValueError(f"reflect shifts must be smaller than the image ({h}x{w}), got "
                         f"|sy| <= {np.abs(sy).max()}, |sx| <= {np.abs(sx).max()}")
    if array_module(images) is np:
        return _shift_flip_numpy(images, sy, sx, flip, mode)
    return shift_flip_gather(images, sy, sx, flip, mode)


def pad_crop(images, dy, dx, pad: int, mode: str = "zero"):
    """Pad by ``pad`` pixels on each side, then crop the H x W window at offset (dy, dx).

    dy, dx: (N,) ints in [0, 2*pad]; (pad, pad) is the identity. Same as
    ``np.pad(img, pad, mode="constant" | "reflect")[:, dy:dy+H, dx:dx+W]`` per image.
    (N, C, H, W) uint8 -> same.
    """
    return pad_crop_flip(images, dy, dx, None, pad, mode)


def pad_crop_flip(images, dy, dx, mask, pad: int, mode: str = "zero"):
    """``flip(pad_crop(images, dy, dx, pad, mode), mask)`` in one pass over the data."""
    dy, dx = np.asarray(dy, np.int64), np.asarray(dx, np.int64)
    if dy.size and (dy.min() < 0 or dx.min() < 0 or max(dy.max(), dx.max()) > 2 * pad):
        raise ValueError(f"crop offsets dy, dx must be in [0, {2 * pad}] for pad {pad}")
    return shift_flip(images, dy - pad, dx - pad, mask, mode)


def flip(images, mask):
    """Mirror left-right the images where ``mask`` (N,) bool is set. (N, C, H, W) uint8 -> same.

    >>> x = np.arange(6, dtype=np.uint8).reshape(2, 1, 1, 3)
    >>> flip(x, [True, False])[:, 0, 0].tolist()
    [[2, 1, 0], [3, 4, 5]]
    """
    n = len(images)
    return shift_flip(images, np.zeros(n, np.int64), np.zeros(n, np.int64), mask)


def translate(images, ty, tx):
    """Move each image's content by (ty, tx) pixels (down, right), filling with zeros.

    ty, tx: (N,) ints, any sign. (N, C, H, W) uint8 -> same.
    """
    return shift_flip(images, -np.asarray(ty, np.int64), -np.asarray(tx, np.int64))


def _reflect(index: np.ndarray, size: int) -> np.ndarray:
    """Reflect out-of-range indices back into [0, size) (no edge repeat; valid for |overflow| < size)."""
    index = np.abs(index)
    return np.where(index > size - 1, 2 * (size - 1) - index, index)


def _source_index(shift: np.ndarray, flip: np.ndarray | None, size: int, mode: str):
    """(N, size) source indices along one axis and (N, size) bool of those inside the image."""
    base = np.arange(size)
    base = np.where(flip[:, None], size - 1 - base, base) if flip is not None else base[None, :]
    index = base + shift[:, None]
    inside = (index >= 0) & (index < size)
    index = _reflect(index, size) if mode == "reflect" else np.clip(index, 0, size - 1)
    return index, inside


def shift_flip_gather(images, sy, sx, flip, mode: str):
    """`shift_flip` as one index gather (the CuPy path, and the NumPy oracle for the fast path).

    Index arrays are built on the host and moved to the images' device. sy, sx: (N,) int64 and
    flip: (N,) bool, host. (N, C, H, W) uint8 -> same.
    """
    xp = array_module(images)
    n, c, h, w = images.shape
    rows, rows_in = _source_index(sy, None, h, mode)
    cols, cols_in = _source_index(sx, flip, w, mode)
    nn = np.arange(n)[:, None, None, None]
    cc = np.arange(c)[None, :, None, None]
    idx = [xp.asarray(a) for a in (nn, cc, rows[:, None, :, None], cols[:, None, None, :])]
    out = images[tuple(idx)]
    if mode == "zero":
        keep = (rows_in[:, None, :, None] & cols_in[:, None, None, :]).astype(np.uint8)
        out *= xp.asarray(keep)
    return out


def _groups(sy: np.ndarray, sx: np.ndarray, flip: np.ndarray):
    """Yield (indices, sy, sx, flip) for each distinct parameter triple, indices ascending."""
    span = int(sx.max() - sx.min()) + 1
    key = ((sy - sy.min()) * span + (sx - sx.min())) * 2 + flip
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]).tolist()
    for start, stop in zip(starts, starts[1:] + [len(key)]):
        idx = order[start:stop]
        yield idx, int(sy[idx[0]]), int(sx[idx[0]]), bool(flip[idx[0]])


def _keep_table(sy: np.ndarray, sx: np.ndarray, h: int, w: int):
    """Zero-fill masks: (K, H*W) uint8 (255 where pixel (y, x) reads inside the image, else 0),
    one row per distinct shift, and (N,) the row of each image."""
    y0, x0 = sy.min(), sx.min()
    span = int(sx.max() - x0) + 1
    shifts, row = np.unique((sy - y0) * span + (sx - x0), return_inverse=True)
    ys = np.arange(h)[None, :, None] + (shifts // span + y0)[:, None, None]
    xs = np.arange(w)[None, None, :] + (shifts % span + x0)[:, None, None]
    inside = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w)
    return (inside * np.uint8(255)).reshape(len(shifts), h * w), row.reshape(-1)


# Images per block of the zero-fill kernel: a block's slab and masks (~1 MB) stay in the 2 MB L2
# of this machine's cores. 256 beat 128 and 512 at N = 1k, 5k and 20k.
BLOCK = 256


def _mirror_view(out: np.ndarray):
    """(N, C, H, W/8) uint64 view of ``out`` with the word order of each row reversed, or None
    when W is not a multiple of 8. Writing byte-swapped words through it mirrors the rows as they
    are scattered: the whole kernel got ~25% faster at 20k 3x32x32 images than with a separate
    mirror copy before the scatter (measured here)."""
    n, c, h, w = out.shape
    return out.view(np.uint64).reshape(n, c, h, w // 8)[..., ::-1] if w % 8 == 0 else None


def _shift_flip_zero_numpy(images, sy, sx, flip):
    """Zero-fill `shift_flip` on NumPy, in blocks of BLOCK images and never per image.

    A 2-D shift of an image is a 1-D shift of its flat bytes by sy*W + sx, up to the rows and
    wrapped columns that the keep mask clears; so one fancy index on a sliding-window view of the
    flat batch gathers a whole block already shifted. Each block is gathered unflipped-first; the
    flipped tail is mirrored on its way out (`_mirror_view`).
    """
    n, c, h, w = images.shape
    size = c * h * w
    flat = images.reshape(-1)
    windows = as_strided(flat, shape=(flat.size - size + 1, size), strides=(1, 1), writeable=False)
    start = np.arange(n) * size + sy * w + sx
    edge = (start < 0) | (start > flat.size - size)  # only images 0 and N-1 can read outside
    start[edge] = 0
    table, row = _keep_table(sy, sx, h, w)
    out = np.empty_like(images)
    mirror = _mirror_view(out)
    keep = np.empty((min(BLOCK, n), h * w), np.uint8)
    for b0 in range(0, n, BLOCK):
        ids = b0 + np.argsort(flip[b0:b0 + BLOCK], kind="stable")  # unflipped first
        k, m = len(ids), len(ids) - int(flip[b0:b0 + BLOCK].sum())
        slab = windows[start[ids]].reshape(k, c, h * w)
        np.bitwise_and(slab, np.take(table, row[ids], 0, out=keep[:k], mode="clip")[:, None],
                       out=slab)
        slab = slab.reshape(k, c, h, w)
        out[ids[:m]] = slab[:m]
        if m < k and mirror is not None:
            words = slab[m:].view(np.uint64)
            mirror[ids[m:]] = words.byteswap(inplace=True)  # bytes of each word reversed
        elif m < k:
            out[ids[m:]] = slab[m:, ..., ::-1]
    if edge.any():
        e = np.flatnonzero(edge)
        out[e] = shift_flip_gather(images[e], sy[e], sx[e], flip[e], "zero")
    return out


def _reflect_numpy(images, sy, sx, flip):
    """Reflect-fill `shift_flip` on NumPy: a loop over the distinct (sy, sx, flip) groups."""
    out = np.empty_like(images)
    for idx, a, b, f in _groups(sy, sx, flip):
        out[idx] = _reflect_group(images, idx, a, b, f)
    return out


def _shift_flip_numpy(images, sy, sx, flip, mode):
    """`shift_flip` on NumPy (contiguous copy first: the zero kernel reads the flat buffer)."""
    images = np.ascontiguousarray(images)
    if len(images) == 0:
        return images.copy()
    if mode == "zero":
        return _shift_flip_zero_numpy(images, sy, sx, flip)
    return _reflect_numpy(images, sy, sx, flip)


def _reflect_group(images, idx, a: int, b: int, f: bool):
    """One (sy, sx, flip) group in reflect mode: gather, reflect-pad by the shift, slice, flip."""
    h, w = images.shape[2:]
    py, px = abs(a), abs(b)
    padded = np.pad(np.take(images, idx, axis=0), ((0, 0), (0, 0), (py, py), (px, px)), "reflect")
    window = padded[:, :, py + a:py + a + h, px + b:px + b + w]
    return window[..., ::-1] if f else window


# ---------------------------------------------------------------------------------------------
# photometric ops


def cutout(images, cy, cx, size: int):
    """Zero a ``size`` x ``size`` square centred at (cy, cx) in each image, clipped to the image.

    cy, cx: (N,) ints (pixel coordinates of the centre); the square covers rows
    ``cy - size//2 .. cy - size//2 + size - 1``. (N, C, H, W) uint8 -> same.

    >>> cutout(np.full((1, 1, 3, 3), 9, np.uint8), [0], [0], 2)[0, 0].tolist()
    [[0, 9, 9], [9, 9, 9], [9, 9, 9]]
    """
    check_images(images)
    xp = array_module(images)
    n, _, h, w = images.shape
    cy, cx = _host_rows(cy, n, "cy", np.int64), _host_rows(cx, n, "cx", np.int64)
    if size < 0:
        raise ValueError(f"cutout size must be >= 0, got {size}")
    y0, x0 = cy - size // 2, cx - size // 2
    rows = np.arange(h)[None, :]
    cols = np.arange(w)[None, :]
    out_r = (rows < y0[:, None]) | (rows >= (y0 + size)[:, None])  # (N, H): row outside square
    out_c = (cols < x0[:, None]) | (cols >= (x0 + size)[:, None])
    keep = xp.asarray(out_r)[:, None, :, None] | xp.asarray(out_c)[:, None, None, :]
    return images * keep.astype(np.uint8)


# Fixed point with 8 fractional bits keeps brightness/contrast exact integer arithmetic, so CPU
# and GPU agree to the byte (no float rounding or fused multiply-add differences). Factors < 2
# keep every intermediate below 2**31.
_FRAC = 8


def brightness_contrast(images, brightness, contrast):
    """Per-image contrast then brightness: ``out = clip(b * (c * (x - m) + m))`` as uint8.

    m is the image's mean over all channels and pixels; brightness b and contrast c are (N,)
    factors in [0, 2) (1 = unchanged), quantized to 1/256. Integer arithmetic throughout.
    (N, C, H, W) uint8 -> same.

    >>> x = np.array([[[[0, 100, 200]]]], np.uint8)
    >>> brightness_contrast(x, [1.0], [0.5])[0, 0, 0].tolist()
    [50, 100, 150]
    """
    check_images(images)
    xp = array_module(images)
    n = len(images)
    b = np.rint(_host_rows(brightness, n, "brightness", np.float64) * (1 << _FRAC))
    c = np.rint(_host_rows(contrast, n, "contrast", np.float64) * (1 << _FRAC))
    if n and (b.min() < 0 or c.min() < 0 or max(b.max(), c.max()) >= 2 << _FRAC):
        raise ValueError("brightness and contrast factors must be in [0, 2)")
    pixels = int(np.prod(images.shape[1:]))
    if n == 0:
        return images.copy()
    total = images.reshape(n, -1).sum(axis=1, dtype=xp.int64)
    mean = ((total << _FRAC) + pixels // 2) // pixels  # mean x 256, rounded
    mean = mean.astype(xp.int32).reshape(n, 1, 1, 1)
    x = (images.astype(xp.int32) << _FRAC) - mean
    x *= xp.asarray(c.astype(np.int32)).reshape(n, 1, 1, 1)
    x = ((x + (1 << (_FRAC - 1))) >> _FRAC) + mean  # c * (x - m) + m, in 1/256 units
    x *= xp.asarray(b.astype(np.int32)).reshape(n, 1, 1, 1)
    x = (x + (1 << (2 * _FRAC - 1))) >> (2 * _FRAC)
    return xp.clip(x, 0, 255).astype(xp.uint8)


def normalize(images, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """Per-channel ``(x - mean) / std`` as float32; mean, std have one value per channel in 0..255 units.

    The last step of augmentation, run where the model runs so that uint8 crosses the network.
    Subtract and multiply by the float32 reciprocal are separate elementwise ops, so NumPy and
    CuPy round identically. (N, C, H, W) uint8 -> (N, C, H, W) float32.

    >>> normalize(np.full((1, 1, 1, 1), 130, np.uint8), [128.0], [2.0]).tolist()
    [[[[1.0]]]]
    """
    check_images(images)
    xp = array_module(images)
    c = images.shape[1]
    mean = np.asarray(mean, np.float32).reshape(-1)
    std = np.asarray(std, np.float32).reshape(-1)
    if mean.shape != (c,) or std.shape != (c,):
        raise ValueError(f"mean and std must have one value per channel ({c}), got "
                         f"{mean.shape[0]} and {std.shape[0]}")
    if (std <= 0).any():
        raise ValueError(f"std must be > 0, got {std.tolist()}")
    out = images.astype(xp.float32)
    out -= xp.asarray(mean.reshape(1, c, 1, 1))
    out *= xp.asarray((np.float32(1) / std).reshape(1, c, 1, 1))
    return out


# ---------------------------------------------------------------------------------------------
# crops that change the scale (image folders)


# Bilinear weights in fixed point with 8 fractional bits: integer arithmetic end to end, so NumPy
# and CuPy give the same bytes. Rows then columns: 255 * 256 fits uint16, 65280 * 256 fits uint32.
_WBITS = 8


def _bilinear_taps(start, length, out: int, size: int, flip=None):
    """Source taps of ``out`` output pixels resampling [start, start + length) of an axis.

    Pixel centres map as in PIL and torchvision (``align_corners=False``): output pixel i samples
    ``start + (i + 0.5) * length / out - 0.5``, clamped to the axis. Returns host (N, out) int64
    lower taps, upper taps and uint16 weights of the upper tap in 1/256; ``flip`` (N,) bool
    reverses an image's output order (a mirror fused into the gather).
    """
    start, length = np.asarray(start, np.float64), np.asarray(length, np.float64)
    pos = start[:, None] + (np.arange(out) + 0.5)[None, :] * (length[:, None] / out) - 0.5
    pos = np.clip(pos, 0, size - 1)
    lo = np.floor(pos).astype(np.int64)
    weight = np.rint((pos - lo) * (1 << _WBITS)).astype(np.uint16)
    hi = np.minimum(lo + 1, size - 1)
    if flip is not None and flip.any():
        lo[flip], hi[flip], weight[flip] = lo[flip, ::-1], hi[flip, ::-1], weight[flip, ::-1]
    return lo, hi, weight


def resized_crop(images, top, left, height, width, size: tuple, flip=None):
    """Crop the box (top, left, height, width) of each image and resize it to ``size`` bilinearly,
    mirrored left-right where ``flip``: torchvision's ``resized_crop`` (no antialiasing, so meant
    for boxes no more than ~1.5x the output; RandomResizedCrop's boxes are at most the image).

    images: (N, C, H, W) uint8 (NumPy or CuPy); top, left, height, width: (N,) ints, the box inside
    the image; size: (out_h, out_w); flip: (N,) bool or None. Returns (N, C, out_h, out_w) uint8.
    Four row gathers with host-built index arrays, no loop over images.

    >>> x = np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4) * 10
    >>> resized_crop(x, [1], [1], [2], [2], (2, 2))[0, 0].tolist()
    [[50, 60], [90, 100]]
    >>> resized_crop(x, [0], [0], [4], [4], (2, 2), flip=[True])[0, 0].tolist()
    [[45, 25], [125, 105]]
    """
    check_images(images)
    xp = array_module(images)
    n, c, h, w = images.shape
    out_h, out_w = (int(s) for s in size)
    top, left = _host_rows(top, n, "top", np.int64), _host_rows(left, n, "left", np.int64)
    height = _host_rows(height, n, "height", np.int64)
    width = _host_rows(width, n, "width", np.int64)
    flip = None if flip is None else _host_rows(flip, n, "flip", bool)
    if n and (top.min() < 0 or left.min() < 0 or height.min() < 1 or width.min() < 1
              or (top + height).max() > h or (left + width).max() > w):
        raise ValueError(f"crop boxes must lie inside the {h}x{w} images")
    if n == 0:
        return xp.zeros((0, c, out_h, out_w), xp.uint8)
    y0, y1, wy = _bilinear_taps(top, height, out_h, h)
    x0, x1, wx = _bilinear_taps(left, width, out_w, w, flip)
    # Rows: gather whole rows of W bytes from the flat (N*C*H, W) view.
    base = (np.arange(n)[:, None] * c + np.arange(c)[None, :]) * h  # (N, C)
    flat = images.reshape(n * c * h, w)

    def rows(index):  # (N, C, out_h, W)
        return flat[xp.asarray(base[:, :, None] + index[:, None, :])].astype(xp.uint16)

    wy = xp.asarray(wy[:, None, :, None])
    v = rows(y0) * ((1 << _WBITS) - wy) + rows(y1) * wy
    # Columns: move W in front so that each gathered column is one contiguous run of C*out_h.
    v = xp.ascontiguousarray(v.transpose(0, 3, 1, 2)).reshape(n * w, c * out_h)

    def cols(index):  # (N, out_w, C*out_h)
        return v[xp.asarray(np.arange(n)[:, None] * w + index)].astype(xp.uint32)

    wx = xp.asarray(wx[:, :, None]).astype(xp.uint32)
    acc = cols(x0) * ((1 << _WBITS) - wx) + cols(x1) * wx
    out = ((acc + (1 << (2 * _WBITS - 1))) >> (2 * _WBITS)).astype(xp.uint8)
    return xp.ascontiguousarray(out.reshape(n, out_w, c, out_h).transpose(0, 2, 3, 1))


def center_crop(images, size: int):
    """The centred ``size`` x ``size`` window of each image (a slice; the evaluation crop after a
    resize of the shorter side, as torchvision's Resize + CenterCrop).

    (N, C, H, W) uint8 with H, W >= size -> (N, C, size, size).

    >>> center_crop(np.arange(25, dtype=np.uint8).reshape(1, 1, 5, 5), 3)[0, 0, 0].tolist()
    [6, 7, 8]
    """
    check_images(images)
    h, w = images.shape[2:]
    if not 1 <= size <= min(h, w):
        raise ValueError(f"center_crop size must be in [1, {min(h, w)}], got {size}")
    y0, x0 = (h - size) // 2, (w - size) // 2
    return images[:, :, y0:y0 + size, x0:x0 + size]
