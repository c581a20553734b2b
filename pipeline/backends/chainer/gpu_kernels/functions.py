"""Chainer FunctionNodes that run cuDNN graphs on CuPy arrays: convolution (3 graphs) and BatchNorm.

Inputs are made C-contiguous NCHW (a no-op for what our layers hand each other) and outputs are
C-contiguous NCHW, except BatchNorm on the NHWC plan (see ``bn_plan``), whose output is an NCHW
view of NHWC memory. The graphs are looked up before a node is made (``conv_ready``,
``bn_plan``): a shape cuDNN cannot run never gets here. First-order gradients only.
"""
from __future__ import annotations

from pipeline.backends.chainer.compat import chainer
from pipeline.backends.chainer.gpu_kernels import graphs


def _pair(v) -> tuple:
    return tuple(int(i) for i in v) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _no_double_backprop(name: str) -> None:
    if chainer.config.enable_backprop:
        raise NotImplementedError(f"{name}: the cuDNN graphs have no double backprop; use "
                                  "Chainer's functions (PIPELINE_GPU_KERNELS=chainer)")


def _contiguous(a):
    import cupy
    return cupy.ascontiguousarray(a)


def conv_keys(x_shape, w_shape, stride, pad, dtype, tf32: bool, backward: bool) -> list:
    """The graph keys one convolution needs: fprop, plus dgrad and wgrad when it will backprop.

    >>> [k.op for k in conv_keys((2, 3, 8, 8), (4, 3, 3, 3), 1, 1, "float32", False, True)]
    ['conv_fprop', 'conv_dgrad', 'conv_wgrad']
    """
    kinds = ("fprop", "dgrad", "wgrad") if backward else ("fprop",)
    return [graphs.conv_key(k, x_shape, w_shape, _pair(stride), _pair(pad), dtype, tf32)
            for k in kinds]


def conv_ready(x_shape, w_shape, stride, pad, dtype, backward: bool) -> bool:
    """True when cuDNN runs every graph this convolution needs (built now, cached)."""
    keys = conv_keys(x_shape, w_shape, stride, pad, dtype, graphs.tf32_allowed(), backward)
    return all(graphs.get(k) is not None for k in keys)


class Convolution2D(chainer.FunctionNode):
    """y = conv(x, W) + b on cuDNN (dilation 1, one group); the bias is one broadcast add."""

    def __init__(self, stride=1, pad=0):
        self.stride, self.pad = _pair(stride), _pair(pad)

    def _built(self, kind, x_shape, w_shape, dtype):
        key = graphs.conv_key(kind, x_shape, w_shape, self.stride, self.pad, dtype,
                              graphs.tf32_allowed())
        return graphs.get(key)

    def forward_gpu(self, inputs):
        import cupy
        x, w = _contiguous(inputs[0]), _contiguous(inputs[1])
        n, _, h, wd = x.shape
        k, _, kh, kw = w.shape
        y = cupy.empty((n, k, graphs.out_hw(h, kh, self.stride[0], self.pad[0]),
                        graphs.out_hw(wd, kw, self.stride[1], self.pad[1])), dtype=x.dtype)
        graphs.execute(self._built("fprop", x.shape, w.shape, x.dtype.name),
                       {"x": x, "w": w, "out": y})
        if len(inputs) == 3:
            y += inputs[2].reshape(1, k, 1, 1)
        self.retain_inputs((0, 1))
        return y,

    def backward(self, indexes, grad_outputs):
        import cupy
        _no_double_backprop("convolution_2d")
        x, w = (_contiguous(v.array) for v in self.get_retained_inputs())
        gy = _contiguous(grad_outputs[0].array)
        grads = {}
        if 0 in indexes:
            gx = grads[0] = cupy.empty(x.shape, dtype=x.dtype)
            graphs.execute(self._built("dgrad", x.shape, w.shape, x.dtype.name),
                           {"dy": gy, "w": w, "out": gx})
        if 1 in indexes:
            gw = grads[1] = cupy.empty(w.shape, dtype=w.dtype)
            graphs.execute(self._built("wgrad", x.shape, w.shape, x.dtype.name),
                           {"x": x, "dy": gy, "out": gw})
        if 2 in indexes:  # over (H, W) first: N x C blocks rather than C (see compat's BN note)
            grads[2] = gy.sum(axis=(2, 3)).sum(axis=0)
        return tuple(chainer.Variable(grads[i]) for i in indexes)


def bn_plan(x_shape, dtype, eps: float, decay: float, kinds=("train", "backward")):
    """The layout cuDNN runs this BatchNorm in: "nchw", else "nhwc" (via transposes), else None.

    cuDNN's BatchNorm engines are written for channels-last data; where the NCHW graph does not
    build, the NHWC one costs a transpose of x (and of the gradient) each way.
    """
    for layout in ("nchw", "nhwc"):
        keys = [graphs.bn_key(kind, x_shape, dtype, layout) for kind in kinds]
        if all(graphs.get(k, eps=float(eps), decay=float(decay)) is not None for k in keys):
            return layout
    return None


def _in_layout(x, layout):
    """NCHW-shaped x -> contiguous memory in ``layout`` (NCHW shape, maybe an NHWC view)."""
    if layout == "nchw":
        return _contiguous(x)
    return _contiguous(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _empty_like_layout(x, layout):
    import cupy
    if layout == "nchw":
        return cupy.empty(x.shape, dtype=x.dtype)
    n, c, h, w = x.shape
    return cupy.empty((n, h, w, c), dtype=x.dtype).transpose(0, 3, 1, 2)


class BatchNormalization(chainer.FunctionNode):
    """Training-mode BN over (N, H, W) per channel on cuDNN, updating the running statistics in
    place (cuDNN's momentum is 1 - decay; its running variance is the unbiased one, as Chainer's)."""

    def __init__(self, layout, eps=2e-5, running_mean=None, running_var=None, decay=0.9):
        self.layout, self.eps, self.decay = layout, float(eps), float(decay)
        self.running_mean, self.running_var = running_mean, running_var

    def _built(self, kind, x):
        return graphs.get(graphs.bn_key(kind, x.shape, x.dtype.name, self.layout),
                          eps=self.eps, decay=self.decay)

    def forward_gpu(self, inputs):
        import cupy
        x, gamma, beta = inputs
        x = _in_layout(x, self.layout)
        c = x.shape[1]
        y = _empty_like_layout(x, self.layout)
        self.saved_mean = cupy.empty(c, dtype=cupy.float32)
        self.saved_inv_std = cupy.empty(c, dtype=cupy.float32)
        mean, var = self.running_mean, self.running_var
        if mean is None:  # no running statistics to keep: scratch ones
            mean, var = cupy.zeros(c, cupy.float32), cupy.ones(c, cupy.float32)
        graphs.execute(self._built("train", x), {
            "x": x, "gamma": _contiguous(gamma), "beta": _contiguous(beta), "mean": mean,
            "var": var, "next_mean": mean, "next_var": var, "y": y,
            "saved_mean": self.saved_mean, "saved_inv_std": self.saved_inv_std})
        self.retain_inputs((0, 1))
        return y,

    def backward(self, indexes, grad_outputs):
        import cupy
        _no_double_backprop("batch_normalization")
        x, gamma = (v.array for v in self.get_retained_inputs())
        x = _in_layout(x, self.layout)
        gy = _in_layout(grad_outputs[0].array, self.layout)
        dx = _empty_like_layout(x, self.layout)
        dgamma = cupy.empty(gamma.shape, dtype=cupy.float32)
        dbeta = cupy.empty(gamma.shape, dtype=cupy.float32)
        graphs.execute(self._built("backward", x), {
            "x": x, "dy": gy, "gamma": _contiguous(gamma), "saved_mean": self.saved_mean,
            "saved_inv_std": self.saved_inv_std, "dx": dx, "dgamma": dgamma, "dbeta": dbeta})
        grads = {0: dx, 1: dgamma.astype(gamma.dtype, copy=False),
                 2: dbeta.astype(gamma.dtype, copy=False)}
        return tuple(chainer.Variable(grads[i]) for i in indexes)


class FixedBatchNormalization(chainer.FunctionNode):
    """Inference BN with given statistics on cuDNN; no backward (used without a graph only)."""

    def __init__(self, layout, eps=2e-5):
        self.layout, self.eps = layout, float(eps)

    def forward_gpu(self, inputs):
        import cupy
        x, gamma, beta, mean, var = inputs
        x = _in_layout(x, self.layout)
        y = _empty_like_layout(x, self.layout)
        inv_std = cupy.reciprocal(cupy.sqrt(var.astype(cupy.float32) + cupy.float32(self.eps)))
        built = graphs.get(graphs.bn_key("inference", x.shape, x.dtype.name, self.layout),
                           eps=self.eps, decay=0.0)
        graphs.execute(built, {"x": x, "gamma": _contiguous(gamma), "beta": _contiguous(beta),
                               "mean": _contiguous(mean.astype(cupy.float32, copy=False)),
                               "inv_std": inv_std, "y": y})
        return y,

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError("fixed_batch_normalization: the cuDNN node is inference-only")


__all__ = ["conv_keys", "conv_ready", "Convolution2D", "bn_plan", "BatchNormalization",
           "FixedBatchNormalization"]
