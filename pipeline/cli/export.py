"""The command line of results that leave the project: ``export`` (a run as an ONNX file) and
``predict --onnx`` (that file run by onnxruntime, without Chainer)."""
from __future__ import annotations

from pipeline.core.errors import UsageError


def add_subcommands(sub) -> None:
    p = sub.add_parser("export", help="write a trained run's network as an ONNX file",
                       description="The trained network of --run OUT as an ONNX graph: input "
                                   "'pixels' float32 (N, 3, S, S), RGB, 0-255, normalised "
                                   "inside; outputs 'probabilities' and 'logits' (N, classes); "
                                   "class names, image size and centre crop in its metadata.")
    p.add_argument("--run", metavar="OUT", required=True, help="a run directory written by train")
    p.add_argument("--model", metavar="pkg.module:factory",
                   help="a run of your own model: name it again (a run directory never imports "
                        "code)")
    p.add_argument("--format", choices=("onnx",), default="onnx", help="(default: onnx)")
    p.add_argument("--out", metavar="FILE", required=True, help="the file to write (model.onnx)")
    p.set_defaults(func=_run_export)


def _run_export(args) -> int:
    from pipeline.training.export import export
    print(export(args.run, args.out, model=args.model, fmt=args.format))
    return 0


def predict_onnx(args):
    """``predict --onnx FILE``: the Prediction of the exported file (no Chainer imported)."""
    if args.model or getattr(args, "train.tta"):
        raise UsageError("predict: --onnx runs the exported file as it is: no --model, no --tta")
    from pipeline.training.export import predict_onnx as run
    return run(args.onnx, args.images)
