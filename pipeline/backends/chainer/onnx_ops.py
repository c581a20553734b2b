"""One ONNX form per Chainer function: a FunctionNode of an inference forward -> ONNX nodes.

Each converter is a pure function ``(fn, Call) -> [NodeProto]`` keyed by the FunctionNode's
class name in :data:`CONVERTERS`; ``Call`` carries the names and traced shapes of the node's
inputs and outputs and a place for constants. Shapes are the traced ones: pooling and
convolution pads are read back from them, so Chainer's ``cover_all`` (one more output row than
the floor rule) becomes an explicit extra end pad, and a reshape keeps the batch dimension
dynamic (``0``: copy it). Opset :data:`OPSET` (ReduceMean's axes an attribute, ReduceSum's an
input, as ONNX 13-17 have them).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

OPSET = 17


def make_node(*args, **kwargs):
    """``onnx.helper.make_node``; onnx (the [onnx] extra) is imported on the first export, not
    with the package (pytest's doctest collection imports every module)."""
    from onnx import helper
    return helper.make_node(*args, **kwargs)


class Call(NamedTuple):
    """One FunctionNode as the converter sees it."""
    ins: list  # names of its inputs (the graph's value names)
    outs: list  # names of its outputs
    in_shapes: list  # traced shapes of its inputs
    out_shapes: list  # traced shapes of its outputs
    constants: dict  # name -> np.ndarray: initializers the converter adds
    prefix: str  # a unique name stem for this node's own constants
    batch: int  # the traced batch size (dimension 0 of the graph's input)

    def constant(self, what: str, value) -> str:
        name = f"{self.prefix}/{what}"
        self.constants[name] = np.asarray(value)
        return name


def _node(op: str, call: Call, ins=None, **attrs):
    return make_node(op, call.ins if ins is None else ins, call.outs[:1],
                            name=call.prefix, **attrs)


def _window_pads(call: Call, ksize, stride, pad, dilate=(1, 1)) -> list:
    """ONNX ``pads`` (begins, ends) giving the traced output size with the floor rule: the end
    pad grows by the rows Chainer's ``cover_all`` added (it pads them with -inf for max pooling,
    0 for convolution, as ONNX does)."""
    begins, ends = [], []
    for size, out, k, s, p, d in zip(call.in_shapes[0][2:], call.out_shapes[0][2:], ksize,
                                      stride, pad, dilate):
        extra = (out - 1) * s + (k - 1) * d + 1 - (size + 2 * p)
        begins.append(p)
        ends.append(p + max(extra, 0))
    return begins + ends


def _pair(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def convolution(fn, call: Call) -> list:
    k = call.in_shapes[1][2:]
    stride, pad, dilate = (fn.sy, fn.sx), (fn.ph, fn.pw), (fn.dy, fn.dx)
    return [_node("Conv", call, kernel_shape=list(k), strides=list(stride), dilations=list(dilate),
                  pads=_window_pads(call, k, stride, pad, dilate), group=fn.groups)]


def linear(fn, call: Call) -> list:
    if len(call.in_shapes[0]) != 2:
        raise NotImplementedError("LinearFunction with n_batch_axes > 1")
    return [_node("Gemm", call, transB=1)]  # x W^T (+ b): W is (out, in) as Chainer keeps it


def max_pooling(fn, call: Call) -> list:
    if len(fn.ksize) != 2:
        raise NotImplementedError(f"{len(fn.ksize)}-D max pooling")
    return [_node("MaxPool", call, kernel_shape=list(fn.ksize), strides=list(fn.stride),
                  pads=_window_pads(call, fn.ksize, fn.stride, fn.pad))]


def average_pooling(fn, call: Call) -> list:
    """Chainer divides by the whole window, padding included: ``count_include_pad``."""
    if hasattr(fn, "ksize"):  # AveragePoolingND
        ksize, stride, pad = fn.ksize, fn.stride, fn.pad
        if len(ksize) != 2 or getattr(fn, "pad_value", 0) is None:
            raise NotImplementedError("average pooling other than 2-D with pad_value 0")
    else:
        ksize, stride, pad = (fn.kh, fn.kw), (fn.sy, fn.sx), (fn.ph, fn.pw)
    return [_node("AveragePool", call, kernel_shape=list(ksize), strides=list(stride),
                  pads=_window_pads(call, ksize, stride, pad), count_include_pad=1)]


def fixed_batch_normalization(fn, call: Call) -> list:
    if getattr(fn, "axis", None) not in (None, (0, 2, 3), (0,)):
        raise NotImplementedError(f"BatchNormalization over axes {fn.axis}")
    return [_node("BatchNormalization", call, epsilon=float(fn.eps))]


def lrn(fn, call: Call) -> list:
    """Chainer: x / (k + alpha * sum of n squares)^beta; ONNX divides alpha by size."""
    return [_node("LRN", call, size=int(fn.n), alpha=float(fn.alpha * fn.n),
                  beta=float(fn.beta), bias=float(fn.k))]


def reshape(fn, call: Call) -> list:
    src, dst = call.in_shapes[0], call.out_shapes[0]
    if not (src and dst and src[0] == dst[0] == call.batch):
        raise NotImplementedError(f"Reshape {tuple(src)} -> {tuple(dst)} across the batch axis")
    shape = call.constant("shape", np.array([0, *dst[1:]], np.int64))
    return [_node("Reshape", call, ins=[call.ins[0], shape])]


def _axes(fn, ndim: int) -> list:
    axes = range(ndim) if fn.axis is None else fn.axis
    axes = sorted(a % ndim for a in axes)
    if 0 in axes:
        raise NotImplementedError("a reduction over the batch axis")
    return axes


def mean(fn, call: Call) -> list:
    return [_node("ReduceMean", call, axes=_axes(fn, len(call.in_shapes[0])),
                  keepdims=int(fn.keepdims))]


def sum_(fn, call: Call) -> list:
    axes = call.constant("axes", np.array(_axes(fn, len(call.in_shapes[0])), np.int64))
    return [_node("ReduceSum", call, ins=[call.ins[0], axes], keepdims=int(fn.keepdims))]


def concat(fn, call: Call) -> list:
    return [_node("Concat", call, axis=int(fn.axis))]


def stack(fn, call: Call) -> list:
    axis = fn.axis % (len(call.in_shapes[0]) + 1)
    axes = call.constant("axes", np.array([axis], np.int64))
    parts = [f"{call.prefix}/part{i}" for i in range(len(call.ins))]
    return [make_node("Unsqueeze", [x, axes], [p], name=p)
            for x, p in zip(call.ins, parts)] + [_node("Concat", call, ins=parts, axis=axis)]


def get_item(fn, call: Call) -> list:
    """Basic slicing only (slices with steps, ``...`` not included)."""
    slices = fn.slices if isinstance(fn.slices, tuple) else (fn.slices,)
    if not all(isinstance(s, slice) and s.step in (None, 1) for s in slices):
        raise NotImplementedError(f"GetItem {slices!r}: only plain slices")
    shape = call.in_shapes[0]
    picked = [(i, s) for i, s in enumerate(slices) if s != slice(None)]
    if any(i == 0 for i, _ in picked):
        raise NotImplementedError("slicing the batch axis")
    starts = [s.indices(shape[i])[0] for i, s in picked]
    ends = [s.indices(shape[i])[1] for i, s in picked]
    ins = [call.ins[0]] + [call.constant(n, np.array(v, np.int64)) for n, v in
                           (("starts", starts), ("ends", ends), ("axes", [i for i, _ in picked]))]
    return [_node("Slice", call, ins=ins)]


def softmax(fn, call: Call) -> list:
    return [_node("Softmax", call, axis=int(fn.axis))]


def _unary(op: str, **attrs) -> Callable:
    return lambda fn, call: [_node(op, call, **attrs)]


def _with_constant(op: str, reverse: bool = False) -> Callable:
    """``x op value`` (``value op x`` when ``reverse``) for Chainer's *Constant functions."""
    def convert(fn, call):
        value = call.constant("value", np.asarray(fn.value, np.float32))
        return [_node(op, call, ins=[value, call.ins[0]] if reverse else [call.ins[0], value])]
    return convert


def leaky_relu(fn, call: Call) -> list:
    return [_node("LeakyRelu", call, alpha=float(fn.slope))]


def clipped_relu(fn, call: Call) -> list:
    low = call.constant("min", np.float32(0))
    high = call.constant("max", np.float32(fn.cap))
    return [_node("Clip", call, ins=[call.ins[0], low, high])]


def identity(fn, call: Call) -> list:
    return [make_node("Identity", call.ins[:1], call.outs[:1], name=call.prefix)]


# FunctionNode class name -> converter. Dropout, an inference no-op, leaves no node in Chainer's
# graph; Copy and Identity (F.copy, F.identity) pass through.
CONVERTERS: dict[str, Callable] = {
    "Convolution2DFunction": convolution,
    "LinearFunction": linear,
    "MaxPoolingND": max_pooling, "MaxPooling2D": max_pooling,
    "AveragePooling2D": average_pooling, "AveragePoolingND": average_pooling,
    "FixedBatchNormalization": fixed_batch_normalization,
    "LocalResponseNormalization": lrn,
    "Reshape": reshape,
    "Mean": mean, "Sum": sum_,
    "Concat": concat, "Stack": stack, "GetItem": get_item,
    "Softmax": softmax,
    "ReLU": _unary("Relu"), "Sigmoid": _unary("Sigmoid"), "Tanh": _unary("Tanh"),
    "LeakyReLU": leaky_relu, "ClippedReLU": clipped_relu,
    "Add": _unary("Add"), "Sub": _unary("Sub"), "Mul": _unary("Mul"), "Div": _unary("Div"),
    "AddConstant": _with_constant("Add"), "MulConstant": _with_constant("Mul"),
    "SubFromConstant": _with_constant("Sub", reverse=True),
    "DivFromConstant": _with_constant("Div", reverse=True),
    "Neg": _unary("Neg"), "Exp": _unary("Exp"), "Absolute": _unary("Abs"),
    "Copy": identity, "Identity": identity,
}


def convert(fn, call: Call) -> list:
    """The ONNX nodes of one FunctionNode; ``KeyError`` when it has no ONNX form here,
    ``NotImplementedError`` (with the reason) for arguments this converter does not take."""
    return CONVERTERS[type(fn).__name__](fn, call)


def tensor(name: str, array: np.ndarray):
    """An initializer (float64 constants kept as float32, the dtype the graph computes in)."""
    from onnx import numpy_helper
    array = np.asarray(array)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return numpy_helper.from_array(np.ascontiguousarray(array), name)
