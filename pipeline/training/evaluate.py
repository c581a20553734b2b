"""Trained models back from disk (``load_model(OUT)``) and their test accuracy, one evaluate- task per
test chunk (local threads)."""
from __future__ import annotations

from pathlib import Path

import dask

from pipeline.backends import get_backend, model_label
from pipeline.backends import user as user_code
from pipeline.core import keys, npz
from pipeline.core.errors import DataError, UsageError
from pipeline.training import tasks


def read_weights(model_name, weights: str, n_classes: int, backend: str = "chainer") -> dict:
    """The state dict in ``weights`` (a ``model.npz``), checked against the model (a registry
    name or a resolved ``ModelRef``: ``model_of``).

    Read with our own ``.npz`` reader (``pipeline.core.npz``: no pickles, sizes checked first),
    never Chainer's ``load_npz``, which unpickles. DataError for a file that is not a readable
    ``.npz``; UsageError when its arrays are not the model's.
    """
    if isinstance(model_name, str) and user_code.is_import_path(model_name):
        raise user_code.needs_model()  # a run's recorded path (predict --run): never imported
    framework = get_backend(backend)  # model.backend
    framework.check_model(model_name)
    try:
        return framework.load_weights(model_name, n_classes, weights)
    except npz.Mismatch as exc:
        raise UsageError(f"weights {weights} do not fit model {model_label(model_name)} "
                         f"({n_classes} classes): {exc.reason}") from None


def model_of(config, model, n_classes: int):
    """What to build for ``config``'s model: its registry name, or (for the user's code, only
    when ``model`` names it again: a run directory never imports code) a checked ``ModelRef``
    at the size the run recorded."""
    from pipeline.training import prepare
    recorded = config.model.name
    config, factory = prepare.user_model(config, model)
    user_code.paired(recorded, config.model.name)  # the run's model.args go to its own model only
    return get_backend(config.model.backend).resolve_model(
        config.model.name, config.model.args, factory, prepare.image_size(config, None), n_classes)


def load_weights(model_name, weights: str, n_classes: int, backend: str = "chainer"):
    """The model (a Chainer Link) with the weights of ``weights``; see read_weights."""
    params = read_weights(model_name, weights, n_classes, backend)
    return get_backend(backend).to_model(model_name, n_classes, params)


def evaluate_weights(model_name, weights: str, source: str, tta: bool = False,
                     chunk: int = 1000, data=None, model_args: str = "{}",
                     backend: str = "chainer") -> dict:
    """``{"test_loss", "test_acc", "n"}`` of the weights on the test split of ``source`` (an
    image source's val split: ``val_loss``, ``val_acc``); ``data``: the DataConfig that says
    how to read it.
    ``model_name``: a registry name, or an import path the user named (imported, with
    ``model_args``, and checked at the data's image size)."""
    from pipeline.data.datasets import load_dataset
    ds = load_dataset(source, data)
    if isinstance(model_name, str):
        factory = model_name if user_code.is_import_path(model_name) else None
        model_name = get_backend(backend).resolve_model(model_name, model_args, factory,
                                                 tuple(ds.test_images.shape[2:]), ds.n_classes)
    params = read_weights(model_name, weights, ds.n_classes, backend)
    spec = tasks.EvalSpec(model_name, ds.n_classes, tta, backend=backend)
    return _evaluate(params, ds.test_images, ds.test_labels, spec, chunk, ds.splits[1])


def evaluate_kept(model_name, weights: str, out: str | Path, n_classes: int,
                  tta: bool = False, chunk: int = 1000, backend: str = "chainer") -> dict:
    """:func:`evaluate_weights` on the evaluation split run ``out`` kept of data no source finds
    again (arrays given from Python: ``pipeline.data.kept``); ``model_name`` resolved already."""
    import dask.array as da
    from pipeline.data import kept
    images, labels = kept.read(out, n_classes)
    params = read_weights(model_name, weights, n_classes, backend)
    spec = tasks.EvalSpec(model_name, n_classes, tta, backend=backend)
    return _evaluate(params, da.from_array(images, chunks=(chunk, -1, -1, -1)),
                     da.from_array(labels, chunks=chunk), spec, chunk)


def _evaluate(params: dict, test_images, test_labels, spec, chunk: int,
              split: str = "test") -> dict:
    """``{"<split>_loss", "<split>_acc", "n"}`` (split: test, or val where the data's reader
    evaluates on a held-out val split): one evaluate- task per ``chunk`` images, local threads."""
    images = test_images.rechunk({0: chunk}).to_delayed().ravel()
    labels = test_labels.rechunk({0: chunk}).to_delayed().ravel()
    token = keys.new_token()
    parts = [dask.delayed(tasks.evaluate, pure=True)(params, x, y, spec,
                                                     dask_key_name=keys.make("evaluate", token, i))
             for i, (x, y) in enumerate(zip(images, labels))]
    results = dask.compute(*parts, scheduler="threads")
    n = sum(r["n"] for r in results)
    return {f"{split}_loss": sum(r["loss_sum"] for r in results) / n,
            f"{split}_acc": sum(r["correct"] for r in results) / n, "n": n}


def run_config(out: str | Path):
    """The :class:`~pipeline.core.config.Config` of run directory ``out`` (its config.json, read as
    any input is: ``rundir.read_config``)."""
    from pipeline.data.datasets import facts
    from pipeline.outputs.fs import read_config
    config = read_config(Path(out), DataError)
    try:
        facts(config.data.dataset)  # a kind some reader records
    except DataError as exc:
        raise DataError(f"{Path(out) / 'config.json'}: {exc}") from None
    return config


def _n_classes(out: Path, config) -> int:
    """Classes of the trained model: summary.json says (the data decides), else the config."""
    from pipeline.outputs.fs import read_json
    try:
        n = read_json(out / "summary.json", DataError)["n_classes"]
        return n if type(n) is int and 2 <= n <= 100_000 else config.model.n_classes
    except (DataError, KeyError, TypeError):
        return config.model.n_classes


def load_model(out: str | Path, model=None):
    """The trained model of run directory ``out``: a Chainer Link of the architecture named in
    ``OUT/config.json`` holding the weights of ``OUT/model.npz``, ready for inference. A run of
    your own model needs it named again: ``model=`` the class or function, or its import path
    (config.json alone never makes us import code)::

        from pipeline import load_model
        model = load_model("runs/ipm")
        with chainer.using_config("train", False):
            logits = model(normalized_images)  # (N, 3, 32, 32) float32 -> (N, classes)

    (``pipeline.training.tasks.predict_proba`` normalizes uint8 images and batches them.) An unfinished run
    has no model.npz; its latest checkpoint's weights are in ``OUT/checkpoints/round-*/``.
    """
    out = Path(out)
    config = run_config(out)
    weights = out / "model.npz"
    if not weights.is_file():
        from pipeline.outputs.fs import checkpoint_dirs
        latest = checkpoint_dirs(out / "checkpoints")
        hint = (f"; its latest checkpoint's weights: {latest[-1][1] / 'model.npz'}" if latest
                else "")
        raise DataError(f"{out} has no model.npz: the run has not finished{hint}")
    n_classes = _n_classes(out, config)
    return load_weights(model_of(config, model, n_classes), str(weights), n_classes,
                        config.model.backend)
