"""Results that leave the project: a trained run as an ONNX file (:func:`export`), and that file
run by onnxruntime on images read as ``predict`` reads them, without Chainer
(:func:`predict_onnx`).

The file's input ``pixels`` is float32 ``(N, 3, S, S)``, RGB, values 0-255 (the uint8 pixels of
the decoded image, cast), ``N`` dynamic; the per-channel normalisation is inside. Its outputs are
``probabilities`` (softmax) and ``logits``, ``(N, classes)``. Its metadata (:data:`KEYS`) says
how the images were read and what the classes are called.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pipeline.core.errors import DataError, UsageError
from pipeline.training import predict as predicting
from pipeline.training import tasks

FORMATS = ("onnx",)
KEYS = {  # metadata key -> its meaning (the values are strings, as ONNX stores them)
    "class_names": "JSON list: output column -> class name",
    "image_size": "S: the side of the square images the input takes",
    "crop": "share of the centred square kept before resizing (image folders: 0.875)",
    "layout": "the input's layout and channel order",
    "pixels": "the input's dtype and value range",
    "mean": "JSON list: per-channel mean subtracted inside the graph (0-255 units)",
    "std": "JSON list: per-channel std divided by inside the graph (0-255 units)",
    "model": "the model's registry name or import path",
}
LAYOUT, PIXELS = "NCHW RGB", "float32 0-255"


def _need(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{module} is not installed: pip install "
                         "'dask-chainer-pipeline[onnx]' (onnx and onnxruntime)") from None


def export(run_or_model, path, *, model=None, fmt: str = "onnx") -> Path:
    """Write the trained network of ``run_or_model`` (a run directory or ``train``'s result;
    ``model``: a run of your own model names it again, as for ``predict``) to ``path`` as an ONNX
    graph (see the module doc). Returns the path. UsageError naming a function with no ONNX
    form."""
    if fmt not in FORMATS:
        raise UsageError(f"export: --format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    _need("onnx")
    from pipeline.backends import get_backend, model_label
    loaded = predicting.load(run_or_model, model)
    spec = tasks.EvalSpec(loaded.name, len(loaded.class_names), cpu_kernels="chainer",
                          backend=loaded.backend)
    metadata = {"class_names": json.dumps(loaded.class_names), "image_size": loaded.side,
                "crop": loaded.crop, "layout": LAYOUT, "pixels": PIXELS,
                "mean": json.dumps([float(v) for v in spec.mean]),
                "std": json.dumps([float(v) for v in spec.std]),
                "model": model_label(loaded.name)}
    data = get_backend(spec.backend).export_onnx(loaded.params, spec, loaded.side, metadata)
    written = _write(Path(path), data)
    _tracked(run_or_model, written)
    return written


def _tracked(run_or_model, path: Path) -> None:
    """A run tracked in MLflow (``mlflow`` in its config, ``OUT/mlflow.json``) gets the exported
    file as one more artifact of its MLflow run (a server that is down: one warning line)."""
    import sys
    if not isinstance(run_or_model, (str, os.PathLike)):
        return
    from pipeline.outputs import mlflow_tracking
    from pipeline.training.evaluate import run_config
    uri = run_config(run_or_model).mlflow
    if uri and (Path(run_or_model) / mlflow_tracking.RECORD).is_file():
        mlflow_tracking.attach(run_or_model, path, uri,
                               log=lambda line: print(line, file=sys.stderr))


def _write(path: Path, data: bytes) -> Path:
    """Whole or not at all: a temporary file beside ``path``, renamed over it."""
    if path.is_dir():
        raise UsageError(f"{path}: is a folder; name the .onnx file to write")
    tmp = path.with_name(f".{path.name}.part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write ({exc.strerror or exc})") from None
    return path


class Exported:
    """An exported file opened for inference: the onnxruntime session and its metadata."""

    def __init__(self, path):
        ort = _need("onnxruntime")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
        try:
            self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own classes for a bad file
            raise DataError(f"{path}: not an ONNX model onnxruntime can run "
                            f"({str(exc).splitlines()[0][:200]})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self.class_names = json.loads(meta["class_names"])
            self.side, self.crop = int(meta["image_size"]), float(meta["crop"])
        except (KeyError, ValueError) as exc:
            raise DataError(f"{path}: no {exc} in its metadata (not written by "
                            "`python -m pipeline export`)") from None

    def proba(self, pixels: np.ndarray, batch_size: int = 100) -> np.ndarray:
        """(N, 3, S, S) uint8 -> (N, classes) float32 probabilities."""
        if len(pixels) == 0:
            return np.zeros((0, len(self.class_names)), np.float32)
        return np.concatenate([
            self.session.run(["probabilities"],
                             {"pixels": pixels[lo:lo + batch_size].astype(np.float32)})[0]
            for lo in range(0, len(pixels), batch_size)])


def predict_onnx(path, images, *, batch_size: int = 100) -> predicting.Prediction:
    """``predict`` with an exported file in place of the run: the images (files, folders or a
    ``(N, 3, S, S) uint8`` array) read at the file's image size and centre crop, the class
    probabilities from onnxruntime. Imports no Chainer."""
    exported = Exported(path)
    reading = predicting.Model(None, {}, exported.class_names, exported.side, exported.crop)
    pixels, labels = predicting.read_images(images, reading)
    return predicting.Prediction(exported.proba(pixels, batch_size),
                                 list(exported.class_names), labels)
