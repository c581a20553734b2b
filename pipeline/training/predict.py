"""Class probabilities of new images from a trained run: the images read as evaluation reads its
split (the run's config: image size, the centre crop of image sources), the model's softmax, the
class names saved with the run (``OUT/data.json``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pipeline.core.errors import DataError, UsageError
from pipeline.data.cifar import CIFAR10_LABEL_NAMES
from pipeline.data import imagefolder
from pipeline.training import tasks

if TYPE_CHECKING:
    from pipeline.backends import ModelRef

MAX_IMAGES = 100_000  # one predict call decodes at most this many files (memory: N x 3 x S x S)


class Prediction(NamedTuple):
    """What :func:`predict` returns."""
    proba: np.ndarray  # (N, classes) float32 softmax probabilities, rows sum to 1
    class_names: list  # class index -> name, as the run's data named them
    images: list  # one label per row: the file path, or "image i" for arrays

    def __repr__(self) -> str:  # one line, not every probability
        return f"Prediction({len(self.images)} images x {len(self.class_names)} classes)"

    def top(self, k: int = 5) -> list:
        """Per image, the ``k`` most probable ``(class name, probability)``, most probable first.

        >>> p = Prediction(np.array([[.1, .7, .2]], np.float32), ["a", "b", "c"], ["x"])
        >>> [(n, round(v, 2)) for n, v in p.top(2)[0]]
        [('b', 0.7), ('c', 0.2)]
        """
        k = max(1, min(k, self.proba.shape[1]))
        order = np.argsort(-self.proba, axis=1, kind="stable")[:, :k]
        return [[(self.class_names[j], float(row[j])) for j in idx]
                for row, idx in zip(self.proba, order)]


class Model(NamedTuple):
    """A trained model as predict needs it: weights, what they are, how its images were read."""
    name: str | ModelRef  # a registry model name, or the user's own model, resolved
    params: dict  # state dict
    class_names: list
    side: int  # pixels of the square images the model saw
    crop: float  # share of the centred square kept (image sources: EVAL_CROP)
    cpu_kernels: str = "ours"
    backend: str = "chainer"  # model.backend: the framework that builds it


def predict(run_or_model, images, *, tta: bool = False, batch_size: int = 100,
            model=None) -> Prediction:
    """Class probabilities of ``images`` under a trained model.

    ``run_or_model``: a run directory (``OUT``) or what ``train`` returned. ``model``: a run of
    your own model names it again (its class or callable, or ``"pkg.module:factory"``), as
    ``load_model`` takes it: a run directory never imports code. ``images``: an image
    file, a folder (its image files, sorted, nested folders too), a list of those, or a
    ``(N, 3, S, S) uint8`` array already at the run's image size. Files are read as the run's
    evaluation read its split: the centred square resized to the run's size (image folders and
    file lists: to ``size / 0.875``, then the centre ``size`` kept). DataError for an unreadable
    image; UsageError for a run without a model.
    """
    model = load(run_or_model, model)
    pixels, names = read_images(images, model)
    spec = tasks.EvalSpec(model.name, len(model.class_names), tta, batch_size=batch_size,
                          cpu_kernels=model.cpu_kernels, backend=model.backend)
    proba = tasks.predict_proba(model.params, pixels, spec)
    return Prediction(proba, list(model.class_names), names)


def load(run_or_model, model=None) -> Model:
    """A :class:`Model` from a run directory or a ``train`` result (``.params``, ``.config``);
    ``model``: the user's own model named again (see predict)."""
    if isinstance(run_or_model, Model):
        return run_or_model
    if isinstance(run_or_model, (str, os.PathLike)):
        return _from_run(Path(run_or_model), model)
    config, params = getattr(run_or_model, "config", None), getattr(run_or_model, "params", None)
    if config is None or not isinstance(params, dict):
        raise TypeError("predict needs a run directory or the result of train() "
                        f"(got {type(run_or_model).__name__})")
    out = getattr(run_or_model, "out", None)
    record = _data_record(Path(out)) if out else None
    link = getattr(run_or_model, "model", None)  # train's result holds its model already
    from pipeline.training.evaluate import model_of
    if model is None and link is not None and config.model.name not in _registry(config):
        from pipeline.backends import user as user_code
        if user_code.path_of(type(link)) == config.model.name:  # train(model=TheClass): that class again
            model = type(link)
    name = model_of(config, model, config.model.n_classes)
    return _model(config, params, record, name)


def _registry(config) -> tuple:
    from pipeline.backends import get_backend
    return tuple(get_backend(config.model.backend).model_names())


def _from_run(out: Path, model=None) -> Model:
    from pipeline.training.evaluate import _n_classes, model_of, read_weights, run_config
    config = run_config(out)
    weights = out / "model.npz"
    if not weights.is_file():
        from pipeline.training.evaluate import load_model
        load_model(out, model)  # the one line saying where the latest checkpoint's weights are
    record = _data_record(out)
    n_classes = int(record["n_classes"]) if record else _n_classes(out, config)
    name = model_of(config, model, n_classes)  # the user's model: named again, checked
    params = read_weights(name, str(weights), n_classes, config.model.backend)
    return _model(config.replace(**{"model.n_classes": n_classes}), params, record, name)


def _data_record(out: Path) -> dict | None:
    """``OUT/data.json`` (written since runs record their data), or None. Read with room for
    the class names any reader gives (``readers.NAMES_JSON_BYTES``), checked as the readers
    check them; ``image_shape``
    ``[3, S, S]`` with S at most ``MAX_IMAGE_SIZE`` (S is what predict resizes every image to)."""
    from pipeline.core.config_data import MAX_CLASSES, MAX_IMAGE_SIZE
    from pipeline.data.readers import NAMES_JSON_BYTES, check_class_names
    from pipeline.outputs.fs import MAX_CONFIG_BYTES, read_json
    path = out / "data.json"
    if not path.is_file():
        return None
    record = read_json(path, DataError, limit=MAX_CONFIG_BYTES + NAMES_JSON_BYTES)
    names = record.get("class_names") if isinstance(record, dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and record.get("n_classes") == len(names) and 2 <= len(names) <= MAX_CLASSES):
        raise DataError(f"{path}: no list of class names matching n_classes")
    check_class_names(tuple(names), str(path))
    from pipeline.data.datasets import facts
    try:
        facts(record.get("kind"))  # a kind some registered reader records
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    shape = record.get("image_shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3
                                  and all(type(d) is int for d in shape) and shape[0] == 3
                                  and shape[1] == shape[2] and 1 <= shape[2] <= MAX_IMAGE_SIZE):
        raise DataError(f"{path}: image_shape {str(shape)[:40]} is not [3, S, S] with S in "
                        f"1..{MAX_IMAGE_SIZE} pixels")
    return record


def _model(config, params: dict, record: dict | None, name) -> Model:
    from pipeline.data.datasets import facts
    kind = record["kind"] if record else config.data.dataset
    n = config.model.n_classes
    names = record["class_names"] if record else _guess_names(config, n)
    if len(names) != n:
        raise UsageError(f"the run names {len(names)} classes, its model has {n}")
    image_like = facts(kind).image_files or (record is None and _is_image_source(config))
    side = config.data.image_size or _default_side(image_like)
    if record and record.get("image_shape") is not None:
        side = record["image_shape"][-1]
        built = config.model.input_size or config.data.image_size  # what the run says it saw
        if built not in (0, None, side):
            raise DataError(f"data.json's image_shape {record['image_shape']} says the model "
                            f"saw {side}x{side} images; its config says {built}x{built}")
    crop = imagefolder.EVAL_CROP if image_like else 1.0
    return Model(name, params, list(names), side, crop, config.model.cpu_kernels,
                 config.model.backend)


def _default_side(image_like: bool) -> int:
    from pipeline.data.images import DEFAULT_SIZE
    return DEFAULT_SIZE if image_like else 32


def _is_image_source(config) -> bool:
    from pipeline.data.datasets import reader_for
    try:
        return reader_for(config.data.source, config.data).image_files
    except (OSError, DataError):
        return False


def _guess_names(config, n: int) -> list:
    """Class names of a run written before runs recorded them: CIFAR-10's for 10 CIFAR classes,
    an image folder's subfolders if it is still there, else ``class_i``."""
    if _is_image_source(config) and os.path.isdir(config.data.source):
        try:
            split = os.path.join(config.data.source, "train")
            names = imagefolder.class_folders(split if os.path.isdir(split)
                                              else config.data.source)
            if len(names) == n:
                return names
        except DataError:
            pass
    if n == 10 and not _is_image_source(config):
        return list(CIFAR10_LABEL_NAMES)
    return [f"class_{i}" for i in range(n)]


# ---- the images -------------------------------------------------------------------------------

def read_images(images, model: Model) -> tuple[np.ndarray, list]:
    """``((N, 3, side, side) uint8, labels)`` of files, folders or an array (see predict)."""
    if isinstance(images, np.ndarray):
        want = (3, model.side, model.side)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != want:
            raise ValueError(f"images: an array must be (N, {', '.join(map(str, want))}) uint8 "
                             f"(the run's image size), got {images.shape} {images.dtype}")
        return images, [f"image {i}" for i in range(len(images))]
    paths = image_paths(images)
    files = tuple(imagefolder.ImageFile(p, 0, 0, 0) for p in paths)
    chunk = imagefolder.DecodeChunk(files, model.side, model.crop)
    return imagefolder.decode_chunk(chunk)[0], list(paths)


def image_paths(images) -> list:
    """The image files of a path or list of paths: files as given, folders expanded to their
    image files (sorted, nested folders too, hidden ones skipped). DataError for a missing path
    or a folder without images."""
    if isinstance(images, (str, os.PathLike)):
        images = [images]
    found = []
    for item in images:
        path = os.fspath(item)
        if os.path.isdir(path):
            inside = _folder_images(path)
            if not inside:
                raise DataError(f"{path}: no image files in this folder "
                                f"({', '.join(imagefolder.EXTENSIONS)})")
            found += inside
        elif os.path.exists(path):
            found.append(path)
        else:
            raise DataError(f"{path}: no such file or directory")
        if len(found) > MAX_IMAGES:
            raise DataError(f"more than {MAX_IMAGES} images in one predict call")
    if not found:
        raise UsageError("predict: no images given")
    return found


def _folder_images(root: str) -> list:
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(here, n) for n in sorted(names)
                  if not n.startswith(".") and n.lower().endswith(imagefolder.EXTENSIONS)]
    return found
