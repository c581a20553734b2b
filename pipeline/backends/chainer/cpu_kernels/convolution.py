"""2-D convolution on the CPU in NumPy: channels-last im2col in cache-sized chunks and one BLAS GEMM each.

Shapes: x (N, H, W, C), weights (O, C, kh, kw) as Chainer keeps them, y (N, Ho, Wo, O); all
float, C-contiguous. Rows of every GEMM are output pixels (n, i, j), so the products write NHWC
straight into the output and no transpose is ever copied.
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.cpu_kernels import sharing
from pipeline.backends.chainer.cpu_kernels.layout import out_size, pad_nhwc

# Bytes of one im2col chunk: a few images' columns stay in the 1 MiB L2 between the copy and the
# GEMM that reads them. conv2 of cifar10-2015 (25,600 x 800 columns, 82 MB whole) ran its forward
# in 24-30 ms with 1-2 images per chunk against 59 ms for one whole-batch im2col and GEMM.
CHUNK_BYTES = 2 << 20


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Every matrix product of this module goes through here (benchmarks time them alone)."""
    return np.matmul(a, b, out=out)


def _chunks(n: int, row_bytes: int):
    """Image ranges [n0, n1) whose im2col rows take about CHUNK_BYTES."""
    step = max(1, min(n, CHUNK_BYTES // max(1, row_bytes)))
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


# With ``threads`` > 1 a convolution's chunks are dealt round-robin among threads
# (``cpu_kernels.sharing``), each share with its own column buffer; gW's per-chunk products are
# summed in chunk order, so the result is the bits of one thread.


def _columns(xp, kh, kw, sy, sx, ho, wo, ones: bool = False, ranges: list | None = None):
    """Yield ``(n0, n1, col)``: im2col rows (n, i, j) x columns (a, b, c) of images [n0, n1).

    ``ranges``: the chunks to yield (default: all, ``_chunks``).

    One buffer serves every chunk, so each ``col`` is overwritten by the next. With ``ones`` the
    buffer has one more column of ones: a GEMM against a weight matrix whose last row is the bias
    adds the bias for free, and one against gy sums gy into the bias gradient for free.

    The copy: row a of the window at output (n, i, j) is xp[n, i*sy + a, j*sx:j*sx + kw, :],
    kw*C contiguous elements, and so is its place in the column buffer. Viewed as one opaque
    element of that many bytes (a void dtype), each tap row a is a copy of (n, ho, wo) elements
    with j innermost, one memmove per window row; the float view (N, ho, wo, kh, kw, C) costs
    an outer-iterator step per window row instead, which dominated for rows of 48 floats (16
    channels, 3x3: 2.9 -> 2.1 ms per batch) and 9 or 15 (3 channels: 1.6 -> 0.8, 2.7 -> 1.6 ms).
    Same bytes moved, so the same columns.
    """
    xp = np.ascontiguousarray(xp)
    n, _, _, c = xp.shape
    k = kh * kw * c
    rows = ho * wo
    if ranges is None:
        ranges = _chunks(n, rows * k * xp.itemsize)
    buf = np.empty((max(n1 - n0 for n0, n1 in ranges) * rows, k + ones), xp.dtype)
    if ones:
        buf[:, k] = 1
    run = np.dtype(f"V{kw * c * xp.itemsize}")
    s0, s1, s2, _ = xp.strides
    d0 = buf.strides[0]
    for n0, n1 in ranges:
        for a in range(kh):
            dst = np.ndarray((n1 - n0, ho, wo), run, buffer=buf, offset=a * kw * c * xp.itemsize,
                             strides=(rows * d0, wo * d0, d0))
            src = np.ndarray((n1 - n0, ho, wo), run, buffer=xp, offset=n0 * s0 + a * s1,
                             strides=(s0, s1 * sy, s2 * sx))
            np.copyto(dst, src)
        yield n0, n1, buf[:(n1 - n0) * rows]


def _im2col_gemm(xp, wmat, kh, kw, sy, sx, ho, wo, out, ones: bool = False, threads: int = 1):
    """out (N*ho*wo, O) = im2col(xp) @ wmat, one chunk of images at a time.

    xp: padded (N, Hp, Wp, C); wmat: (kh*kw*C [+ 1 bias row if ``ones``], O), any strides.
    """
    xp = np.ascontiguousarray(xp)
    rows = ho * wo

    def share(ranges):
        for n0, n1, col in _columns(xp, kh, kw, sy, sx, ho, wo, ones, ranges):
            gemm(col, wmat, out[n0 * rows:n1 * rows])
    ranges = _chunks(xp.shape[0], rows * kh * kw * xp.shape[3] * xp.itemsize)
    sharing.run(share, sharing.deal(ranges, threads))
    return out


def _weight_rows(w, b=None):
    """(O, C, kh, kw) [+ bias (O,)] -> (O, kh*kw*C [+ 1]) C-contiguous: rows of the (a, b, c) order."""
    o, c, kh, kw = w.shape
    k = kh * kw * c
    wr = np.empty((o, k + (b is not None)), w.dtype)
    wr[:, :k].reshape(o, kh, kw, c)[...] = w.transpose(0, 2, 3, 1)
    if b is not None:
        wr[:, k] = b
    return wr


def forward(x, w, b, stride: tuple, pad: tuple, threads: int = 1):
    """y = conv(x, w) + b: (N, H, W, C), (O, C, kh, kw), (O,) or None -> (N, Ho, Wo, O).

    Returns ``(y, xp)``; ``xp`` is the padded input the backward pass reuses.
    """
    n, h, wd, c = x.shape
    o, _, kh, kw = w.shape
    (sy, sx), (ph, pw) = stride, pad
    ho, wo = out_size(h, kh, sy, ph), out_size(wd, kw, sx, pw)
    xp = pad_nhwc(x, ph, pw)
    y = np.empty((n, ho, wo, o), x.dtype)
    y2 = y.reshape(-1, o)
    if kh == kw == 1 and ph == pw == 0:
        xs = xp if sy == sx == 1 else np.ascontiguousarray(xp[:, ::sy, ::sx])
        gemm(xs.reshape(-1, c), w.reshape(o, c).T, y2)
        if b is not None:
            y2 += b
    else:  # the bias rides in the GEMM: ones column x bias row
        _im2col_gemm(xp, _weight_rows(w, b).T, kh, kw, sy, sx, ho, wo, y2, ones=b is not None,
                     threads=threads)
    return y, xp


def grad_w(xp, gy, kh: int, kw: int, stride: tuple, bias: bool = False, threads: int = 1):
    """dL/dw and dL/db: padded x (N, Hp, Wp, C), gy (N, Ho, Wo, O) -> ((O, C, kh, kw), (O,) or None).

    Recomputes the im2col columns chunk by chunk (a copy within L2) instead of keeping the
    forward pass's whole-batch matrix; the bias gradient comes out of the same GEMMs.
    """
    n, _, _, c = xp.shape
    _, ho, wo, o = gy.shape
    sy, sx = stride
    gy2 = gy.reshape(-1, o)
    if kh == kw == 1:
        xs = xp[:, :sy * ho:sy, :sx * wo:sx].reshape(-1, c)  # free at stride 1
        return gemm(gy2.T, xs).reshape(o, c, 1, 1), (gy2.sum(axis=0) if bias else None)
    k = kh * kw * c
    rows = ho * wo
    xp = np.ascontiguousarray(xp)
    shares = sharing.deal(_chunks(n, rows * k * xp.itemsize), threads)
    if len(shares) > 1:  # every chunk's product kept, then summed in chunk order as below
        products = sharing.in_order(sharing.run(lambda ranges: [
            gemm(gy2[n0 * rows:n1 * rows].T, col)
            for n0, n1, col in _columns(xp, kh, kw, sy, sx, ho, wo, bias, ranges)], shares))
        gwt = products[0]
        for p in products[1:]:
            gwt += p
    else:
        gwt = part = None
        for n0, n1, col in _columns(xp, kh, kw, sy, sx, ho, wo, ones=bias):
            if gwt is None:
                gwt = gemm(gy2[n0 * rows:n1 * rows].T, col)
                part = np.empty_like(gwt)
            else:
                gwt += gemm(gy2[n0 * rows:n1 * rows].T, col, part)
    gw = gwt[:, :k].reshape(o, kh, kw, c).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(gw), (gwt[:, k].copy() if bias else None)


def grad_x(gy, w, x_shape: tuple, stride: tuple, pad: tuple, threads: int = 1):
    """dL/dx: gy (N, Ho, Wo, O), w (O, C, kh, kw) -> (N, H, W, C).

    Stride 1 with pad <= k - 1: the gradient is itself a convolution of gy, padded by
    k - 1 - pad, with the flipped kernel, so it is gathered by the same chunked im2col and GEMM
    and nothing is scattered. Otherwise: one GEMM per chunk to columns, then col2im as kh*kw
    strided adds into a padded buffer.
    """
    n, h, wd, c = x_shape
    o, _, kh, kw = w.shape
    (sy, sx), (ph, pw) = stride, pad
    _, ho, wo, _ = gy.shape
    if (sy, sx) == (1, 1) and ph < kh and pw < kw:
        qh, qw = kh - 1 - ph, kw - 1 - pw
        # ho + 2*qh - kh + 1 == h exactly when the forward covered the input (true at stride 1)
        gyp = pad_nhwc(gy, qh, qw)
        wflip = w[:, :, ::-1, ::-1].transpose(2, 3, 0, 1).reshape(kh * kw * o, c)
        gx = np.empty((n, h, wd, c), gy.dtype)
        return _im2col_gemm(gyp, wflip, kh, kw, 1, 1, h, wd, gx.reshape(-1, c),
                            threads=threads).reshape(gx.shape)
    return _col2im_grad_x(gy, w, x_shape, stride, pad, threads)


def _col2im_grad_x(gy, w, x_shape, stride, pad, threads=1):
    n, h, wd, c = x_shape
    o, _, kh, kw = w.shape
    (sy, sx), (ph, pw) = stride, pad
    _, ho, wo, _ = gy.shape
    wmat = _weight_rows(w)  # columns (a, b, c): c contiguous
    hp, wp = max(h + 2 * ph, sy * (ho - 1) + kh), max(wd + 2 * pw, sx * (wo - 1) + kw)
    gx = np.empty((n, h, wd, c), gy.dtype)
    rows = ho * wo

    def share(ranges):  # chunks write disjoint images of gx
        for n0, n1 in ranges:
            gcol = gemm(gy[n0:n1].reshape(-1, o), wmat).reshape(n1 - n0, ho, wo, kh, kw, c)
            gxp = np.zeros((n1 - n0, hp, wp, c), gy.dtype)
            for a in range(kh):
                for b in range(kw):
                    gxp[:, a:a + sy * ho:sy, b:b + sx * wo:sx] += gcol[:, :, :, a, b]
            gx[n0:n1] = gxp[:, ph:ph + h, pw:pw + wd]
    sharing.run(share, sharing.deal(_chunks(n, rows * c * kh * kw * gy.itemsize), threads))
    return gx
