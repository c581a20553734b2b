"""A Chainer Link as an ONNX model: one traced inference forward, its FunctionNodes converted one
by one (``onnx_ops``), the pixels' normalisation before them and the softmax after.

The forward runs on Chainer's stock functions (``cpu_kernels`` "chainer": our CPU kernels'
FunctionNodes are the same maths under other classes) in inference mode with a graph kept, so
BatchNorm traces as ``FixedBatchNormalization`` and dropout leaves no node. A function hook keeps
every node's input arrays, which is where constants without a Link (BatchNorm's running
statistics, a user's arrays) are read from. onnx-chainer 1.6.0, the last release, does not
import on onnx 1.23 (it reads ``onnx.mapping``, which onnx no longer has), hence this module.

The model's input ``pixels`` is float32 ``(N, 3, side, side)`` with values 0-255 (RGB, NCHW:
uint8 pixels as read, cast), ``N`` dynamic; its outputs ``probabilities`` (softmax, as
``predict`` returns) and ``logits``, both ``(N, classes)`` float32.
"""
from __future__ import annotations

import numpy as np

from pipeline.backends.chainer import onnx_ops
from pipeline.backends.chainer.compat import chainer
from pipeline.core.errors import UsageError

TRACE_BATCH = 3  # images in the traced forward; the graph's batch axis is dynamic
IR_VERSION = 8  # ONNX IR of opset 17's release (1.12): readable by runtimes since 2022
INPUT, PROBABILITIES, LOGITS = "pixels", "probabilities", "logits"


class _Recorder(chainer.FunctionHook):
    """Keeps every FunctionNode's input arrays (Chainer drops the ones a node does not retain)."""
    name = "onnx_export"

    def __init__(self):
        self.inputs = {}  # id(node) -> (node, its input arrays)

    def forward_preprocess(self, function, in_data):
        self.inputs[id(function)] = (function, in_data)


def trace(forward, side: int):
    """``(output Variable, recorder)`` of ``forward`` on a ``(TRACE_BATCH, 3, side, side)``
    float32 batch in inference mode, on Chainer's own functions, graph kept."""
    x = chainer.Variable(np.random.default_rng(0).normal(
        size=(TRACE_BATCH, 3, side, side)).astype(np.float32))
    recorder = _Recorder()
    with chainer.using_config("train", False), chainer.using_config("enable_backprop", True), \
            chainer.using_config("cpu_kernels", "chainer"), recorder:
        y = forward(x)
    if not isinstance(y, chainer.Variable) or y.ndim != 2 or len(y) != TRACE_BATCH:
        raise UsageError("onnx: the model must map (N, 3, H, W) to (N, classes) logits, got "
                         f"{type(y).__name__} {getattr(y, 'shape', '')}")
    return x, y, recorder


def _functions(output) -> list:
    """The FunctionNodes that ``output`` depends on, inputs before users (iterative DFS)."""
    order, seen, stack = [], set(), [(output.creator_node, False)]
    while stack:
        fn, done = stack.pop()
        if fn is None or (not done and id(fn) in seen):
            continue
        if done:
            order.append(fn)
            continue
        seen.add(id(fn))
        stack.append((fn, True))
        stack.extend((node.creator_node, False) for node in reversed(fn.inputs))
    return order


class _Names:
    """ONNX value names of Chainer's variable nodes: parameters and persistent arrays by their
    Link paths (``conv1/W``, ``bn1/avg_mean``), the rest numbered."""

    def __init__(self, link, x):
        self.of = {id(x.node): "normalized"}
        self.params = {id(p.node): path.lstrip("/") for path, p in link.namedparams()}
        self.persistent = {id(getattr(sub, name)): f"{path}/{name}".lstrip("/")
                           for path, sub in link.namedlinks() for name in sub._persistent
                           if isinstance(getattr(sub, name), np.ndarray)}
        self.constants = {}  # name -> array (initializers)

    def input(self, node, array, fn_prefix: str, i: int) -> str:
        if id(node) in self.of:
            return self.of[id(node)]
        if node.creator_node is not None:
            raise AssertionError("a function's output named before the function ran")
        name = (self.params.get(id(node)) or self.persistent.get(id(array))
                or f"{fn_prefix}/in{i}")
        self.constants.setdefault(name, np.asarray(array))
        self.of[id(node)] = name
        return name

    def output(self, ref, fn_prefix: str, j: int) -> str:
        node = ref()
        name = f"{fn_prefix}/out{j}"
        if node is not None:
            self.of[id(node)] = name
        return name


def graph_nodes(link, x, y, recorder, label: str) -> tuple[list, dict, str]:
    """``(ONNX nodes, initializers, name of the logits)`` of the traced graph ``x -> y``; a
    function without an ONNX form: UsageError naming it."""
    names, nodes = _Names(link, x), []
    for k, fn in enumerate(_functions(y)):
        prefix = f"{type(fn).__name__}_{k}"
        arrays = recorder.inputs[id(fn)][1]
        ins = [names.input(node, a, prefix, i) for i, (node, a) in enumerate(zip(fn.inputs,
                                                                                 arrays))]
        outs = [names.output(ref, prefix, j) for j, ref in enumerate(fn.outputs)]
        out_shapes = [None if r() is None else r().shape for r in fn.outputs]
        call = onnx_ops.Call(ins, outs, [n.shape for n in fn.inputs], out_shapes,
                             names.constants, prefix, TRACE_BATCH)
        try:
            nodes += onnx_ops.convert(fn, call)
        except KeyError:
            raise UsageError(f"onnx: Chainer's {type(fn).__name__} (in {label}) has no ONNX "
                             "form in this exporter") from None
        except NotImplementedError as exc:
            raise UsageError(f"onnx: Chainer's {type(fn).__name__} (in {label}): {exc} has no "
                             "ONNX form in this exporter") from None
    return nodes, names.constants, names.of.get(id(y.node), "normalized")


def to_onnx(link, forward, side: int, mean, std, metadata: dict, label: str) -> bytes:
    """The serialized ONNX model of ``link`` (called as ``forward(x)``) on ``side`` x ``side``
    images: pixels 0-255 -> ``(pixels - mean) * (1 / std)`` per channel in float32 (the bits
    of ``augment.normalize``) -> the net -> softmax. ``metadata``: string values, stored as the
    model's metadata_props."""
    import onnx  # the [onnx] extra, imported when used (see onnx_ops.make_node)
    from onnx import TensorProto, helper
    x, y, recorder = trace(forward, side)
    nodes, constants, logits = graph_nodes(link, x, y, recorder, label)
    constants["preprocess/mean"] = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    constants["preprocess/inv_std"] = (np.float32(1) / np.asarray(std, np.float32)
                                       ).reshape(1, -1, 1, 1)
    classes = int(y.shape[1])
    pre = [helper.make_node("Sub", [INPUT, "preprocess/mean"], ["centred"], name="preprocess/sub"),
           helper.make_node("Mul", ["centred", "preprocess/inv_std"], ["normalized"],
                            name="preprocess/scale")]
    post = [helper.make_node("Softmax", [logits], [PROBABILITIES], axis=1, name="softmax"),
            helper.make_node("Identity", [logits], [LOGITS], name="logits")]
    graph = helper.make_graph(
        pre + nodes + post, label,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["N", 3, side, side])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", classes])
         for n in (PROBABILITIES, LOGITS)],
        initializer=[onnx_ops.tensor(n, a) for n, a in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", onnx_ops.OPSET)],
                              producer_name="dask-chainer-pipeline")
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {k: str(v) for k, v in metadata.items()})
    onnx.checker.check_model(model, full_check=False)
    return model.SerializeToString()
