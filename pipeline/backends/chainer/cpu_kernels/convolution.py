"""2-D convolution on the CPU: through oneDNN where it runs, else channels-last im2col and BLAS.

Shapes: x (N, H, W, C), weights (O, C, kh, kw) as Chainer keeps them, y (N, Ho, Wo, O); all
float, C-contiguous. ``forward``, ``grad_x`` and ``grad_w`` hand float32 work to oneDNN
(``cpu_kernels.onednn``: 1.3-2.3x faster, the same layouts in place) and keep the NumPy path for
the rest: im2col in cache-sized chunks and one BLAS GEMM each, whose rows are output pixels
(n, i, j), so the products write NHWC straight into the output and no transpose is ever copied.
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer.cpu_kernels import onednn, sharing
from pipeline.backends.chainer.cpu_kernels.bf16 import from_bf16
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


def _column_groups(w: int, wo: int, kw: int, sx: int, pw: int) -> list:
    """Output columns j with the same taps b inside the input: [(j0, j1, b0, b1)].

    Window j covers input columns j*sx - pw + b, b < kw; those inside [0, w) are b0 <= b < b1.
    Interior columns form one group; each edge touching the padding is a group of its own.
    """
    groups = []
    for j in range(wo):
        b0, b1 = max(0, pw - j * sx), min(kw, w + pw - j * sx)
        if b1 <= b0:
            continue
        if groups and groups[-1][1] == j and groups[-1][2:] == (b0, b1):
            groups[-1] = (groups[-1][0], j + 1, b0, b1)
        else:
            groups.append((j, j + 1, b0, b1))
    return groups


def _columns(x, kh, kw, sy, sx, ho, wo, pad: tuple = (0, 0), ones: bool = False,
             ranges: list | None = None):
    """Yield ``(n0, n1, col)``: im2col rows (n, i, j) x columns (a, b, c) of images [n0, n1).

    ``x``: (N, H, W, C) seen as padded by ``pad = (ph, pw)`` at the top and left and by zeros
    wherever a window reaches past its bottom or right edge; the padding is never copied: those
    places of the column buffer are zeros written once, and the copies fill the rest.
    ``ranges``: the chunks to yield (default: all, ``_chunks``).

    One buffer serves every chunk, so each ``col`` is overwritten by the next. With ``ones`` the
    buffer has one more column of ones: a GEMM against a weight matrix whose last row is the bias
    adds the bias for free, and one against gy sums gy into the bias gradient for free.

    The copy: row a of the window at output (n, i, j) is x[n, i*sy + a - ph, j*sx - pw + b0 :
    j*sx - pw + b1, :], (b1 - b0)*C contiguous elements (b0 = 0, b1 = kw inside the image), and
    so is its place in the column buffer. Viewed as one opaque element of that many bytes (a
    void dtype), each tap row a of a group of columns is a copy of (n, i, j) elements with j
    innermost, one memmove per window row; the float view (N, ho, wo, kh, kw, C) costs an
    outer-iterator step per window row instead, which dominated for rows of 48 floats (16
    channels, 3x3: 2.9 -> 2.1 ms per batch) and 9 or 15 (3 channels: 1.6 -> 0.8, 2.7 -> 1.6 ms).
    Padding this way instead of copying x into a padded array first saves that pass (resnet20:
    ~38 ms a step of padded copies of x and gy); ``_source`` picks which. The same columns.
    """
    x = np.ascontiguousarray(x)
    n, h, w, c = x.shape
    ph, pw = pad
    k = kh * kw * c
    rows = ho * wo
    if ranges is None:
        ranges = _chunks(n, rows * k * x.itemsize)
    groups = _column_groups(w, wo, kw, sx, pw)
    taps = []  # (a, i0, i1): output rows whose tap row a lies inside the image
    for a in range(kh):
        i0 = max(0, -((a - ph) // sy))  # first i with i*sy + a - ph >= 0
        i1 = min(ho, (h - 1 + ph - a) // sy + 1) if h - 1 + ph - a >= 0 else 0
        if i1 > i0:
            taps.append((a, i0, i1))
    whole = (len(taps) == kh and all((i0, i1) == (0, ho) for _, i0, i1 in taps)
             and groups == [(0, wo, 0, kw)])
    chunk_rows = max(n1 - n0 for n0, n1 in ranges) * rows
    buf = (np.empty if whole else np.zeros)((chunk_rows, k + ones), x.dtype)
    if ones:
        buf[:, k] = 1
    s0, s1, s2, _ = x.strides
    d0, item = buf.strides[0], x.itemsize
    for n0, n1 in ranges:
        for a, i0, i1 in taps:
            for j0, j1, b0, b1 in groups:
                run = np.dtype(f"V{(b1 - b0) * c * item}")
                shape = (n1 - n0, i1 - i0, j1 - j0)
                dst = np.ndarray(shape, run, buffer=buf,
                                 offset=(i0 * wo + j0) * d0 + (a * kw + b0) * c * item,
                                 strides=(rows * d0, wo * d0, d0))
                src = np.ndarray(shape, run, buffer=x,
                                 offset=(n0 * s0 + (i0 * sy + a - ph) * s1
                                         + (j0 * sx + b0 - pw) * s2),
                                 strides=(s0, s1 * sy, s2 * sx))
                np.copyto(dst, src)
        yield n0, n1, buf[:(n1 - n0) * rows]


def _source(x, pad: tuple) -> tuple:
    """(x, pad) for ``_columns``: x C-contiguous; padded by a copy when a pad is over 1.

    Read in place, every padded edge column is a copy of its own per tap row and chunk: at pad 1
    (3x3 windows) two more per tap row, cheaper than the copy of x they save (resnet20's
    convolutions 430 -> 413 ms of thread CPU a step), at pad 2 (5x5) four more, dearer than the
    copy (cifar10-2015's convolutions outside their GEMMs 18.8 -> 26.4 ms a step). The same
    columns either way.
    """
    x = np.ascontiguousarray(x)
    if max(pad) > 1:
        return pad_nhwc(x, *pad), (0, 0)
    return x, tuple(pad)


def _im2col_gemm(x, wmat, kh, kw, sy, sx, ho, wo, out, pad: tuple = (0, 0), ones: bool = False,
                 threads: int = 1):
    """out (N*ho*wo, O) = im2col(x padded by ``pad``) @ wmat, one chunk of images at a time.

    x: (N, H, W, C); wmat: (kh*kw*C [+ 1 bias row if ``ones``], O), any strides.
    """
    x, pad = _source(x, pad)
    rows = ho * wo

    def share(ranges):
        for n0, n1, col in _columns(x, kh, kw, sy, sx, ho, wo, pad, ones, ranges):
            gemm(col, wmat, out[n0 * rows:n1 * rows])
    ranges = _chunks(x.shape[0], rows * kh * kw * x.shape[3] * x.itemsize)
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


def _f32(a):
    """float32 of bf16 bits (uint16), for the NumPy path; anything else as it is."""
    return from_bf16(a) if a.dtype == np.uint16 else a


def _read_size(hw: tuple, k: tuple, stride: tuple, pad: tuple) -> tuple:
    """The input's rows and columns the windows read: all of them, or fewer where the last
    window ends before the input does (a 1x1 convolution at stride 2 on an even size never
    reads the last row and column; oneDNN takes no negative right padding, so those are cut).

    >>> _read_size((32, 32), (1, 1), (2, 2), (0, 0)), _read_size((32, 32), (3, 3), (2, 2), (1, 1))
    ((31, 31), (32, 32))
    """
    return tuple(min(size, size + onednn.pad_right(size, kk, s, p))
                 for size, kk, s, p in zip(hw, k, stride, pad))


def _read_part(x, k: tuple, stride: tuple, pad: tuple):
    """x (N, H, W, C) cut to the rows and columns the windows read (a view; x where all)."""
    read = _read_size(x.shape[1:3], k, stride, pad)
    return x if read == x.shape[1:3] else x[:, :read[0], :read[1]]


def forward(x, w, b, stride: tuple, pad: tuple, threads: int = 1, bf16: bool = False):
    """y = conv(x, w) + b: (N, H, W, C), (O, C, kh, kw), (O,) or None -> (N, Ho, Wo, O).

    Returns ``(y, source, source_pad)``: what the backward pass reads for gW, x itself with
    ``pad`` or (``_source``) a padded copy with no more padding; with ``bf16`` (oneDNN's bf16
    convolution, where it runs) x's bf16 bits (uint16), rounded once for both passes.
    """
    n, h, wd, c = x.shape
    o, _, kh, kw = w.shape
    (sy, sx), (ph, pw) = stride, pad
    if n == 0:  # an empty batch (no chunk to cut)
        y = np.zeros((0, out_size(h, kh, sy, ph), out_size(wd, kw, sx, pw), o), x.dtype)
        return y, np.ascontiguousarray(x), tuple(pad)
    x = _read_part(x, (kh, kw), stride, pad)
    if onednn.usable(x.dtype, w.shape, stride, pad, x.shape[1:3]):
        x = np.ascontiguousarray(x)
        if bf16:
            x = onednn.as_bf16(x)
        y = onednn.forward(x, w, b, tuple(stride), tuple(pad), threads, bf16)
        if y is not None:
            return y, x, tuple(pad)
        x = _f32(x)
    ho, wo = out_size(h, kh, sy, ph), out_size(wd, kw, sx, pw)
    x, source_pad = _source(x, pad)
    y = np.empty((n, ho, wo, o), x.dtype)
    y2 = y.reshape(-1, o)
    if kh == kw == 1 and ph == pw == 0:
        xs = x if sy == sx == 1 else np.ascontiguousarray(x[:, ::sy, ::sx])
        gemm(xs.reshape(-1, c), w.reshape(o, c).T, y2)
        if b is not None:
            y2 += b
    else:  # the bias rides in the GEMM: ones column x bias row
        _im2col_gemm(x, _weight_rows(w, b).T, kh, kw, sy, sx, ho, wo, y2, source_pad,
                     ones=b is not None, threads=threads)
    return y, x, source_pad


def grad_w(x, gy, kh: int, kw: int, stride: tuple, pad: tuple = (0, 0), bias: bool = False,
           threads: int = 1, bf16: bool = False):
    """dL/dw and dL/db: x (N, H, W, C) padded by ``pad``, gy (N, Ho, Wo, O) -> ((O, C, kh, kw),
    (O,) or None).

    Recomputes the im2col columns chunk by chunk (a copy within L2) instead of keeping the
    forward pass's whole-batch matrix; the bias gradient comes out of the same GEMMs.
    """
    n, h, wd, c = x.shape
    _, ho, wo, o = gy.shape
    if n == 0:
        dtype = _f32(gy[:0]).dtype
        return np.zeros((o, c, kh, kw), dtype), (np.zeros(o, dtype) if bias else None)
    if onednn.usable(x.dtype, (o, c, kh, kw), stride, pad, (h, wd)):
        done = onednn.grad_w(x, gy, (o, c, kh, kw), tuple(stride), tuple(pad), bias, threads,
                             bf16 or x.dtype == np.uint16)
        if done is not None:
            return done
    x, gy = _f32(x), _f32(gy)
    sy, sx = stride
    gy2 = gy.reshape(-1, o)
    if kh == kw == 1 and tuple(pad) == (0, 0):
        xs = x[:, :sy * ho:sy, :sx * wo:sx].reshape(-1, c)  # free at stride 1
        return gemm(gy2.T, xs).reshape(o, c, 1, 1), (gy2.sum(axis=0) if bias else None)
    k = kh * kw * c
    rows = ho * wo
    x, pad = _source(x, pad)
    shares = sharing.deal(_chunks(n, rows * k * x.itemsize), threads)
    if len(shares) > 1:  # every chunk's product kept, then summed in chunk order as below
        products = sharing.in_order(sharing.run(lambda ranges: [
            gemm(gy2[n0 * rows:n1 * rows].T, col)
            for n0, n1, col in _columns(x, kh, kw, sy, sx, ho, wo, pad, bias, ranges)], shares))
        gwt = products[0]
        for p in products[1:]:
            gwt += p
    else:
        gwt = part = None
        for n0, n1, col in _columns(x, kh, kw, sy, sx, ho, wo, pad, ones=bias):
            if gwt is None:
                gwt = gemm(gy2[n0 * rows:n1 * rows].T, col)
                part = np.empty_like(gwt)
            else:
                gwt += gemm(gy2[n0 * rows:n1 * rows].T, col, part)
    gw = gwt[:, :k].reshape(o, kh, kw, c).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(gw), (gwt[:, k].copy() if bias else None)


def grad_x(gy, w, x_shape: tuple, stride: tuple, pad: tuple, threads: int = 1,
           bf16: bool = False):
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
    if n == 0:
        return np.zeros(x_shape, _f32(gy[:0]).dtype)
    read = _read_size((h, wd), (kh, kw), stride, pad)
    if onednn.usable(gy.dtype, w.shape, stride, pad, read):
        part = onednn.grad_x(gy, w, (n, *read, c), tuple(stride), tuple(pad), threads,
                             bf16 or gy.dtype == np.uint16)
        if part is not None and read != (h, wd):  # no gradient where no window reads
            gx = np.zeros(x_shape, part.dtype)
            gx[:, :read[0], :read[1]] = part
            return gx
        if part is not None:
            return part
    gy = _f32(gy)
    if (sy, sx) == (1, 1) and ph < kh and pw < kw:
        qh, qw = kh - 1 - ph, kw - 1 - pw
        # ho + 2*qh - kh + 1 == h exactly when the forward covered the input (true at stride 1)
        wflip = w[:, :, ::-1, ::-1].transpose(2, 3, 0, 1).reshape(kh * kw * o, c)
        gx = np.empty((n, h, wd, c), gy.dtype)
        return _im2col_gemm(gy, wflip, kh, kw, 1, 1, h, wd, gx.reshape(-1, c), (qh, qw),
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
