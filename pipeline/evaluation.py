"""Evaluate saved weights on a dataset's test split, one evaluate- task per test chunk (local threads)."""
from __future__ import annotations

import uuid

import dask

from pipeline import tasks
from pipeline.compat import serializers
from pipeline.errors import DataError, UsageError
from pipeline.models import build_model, check_model_name
from pipeline.state import get_state


def load_weights(model_name: str, weights: str, n_classes: int):
    """A registry model with the weights of ``weights`` (a Chainer npz); UsageError if they do not fit."""
    check_model_name(model_name)
    model = build_model(model_name, n_classes)
    try:
        serializers.load_npz(weights, model)
    except FileNotFoundError:
        raise DataError(f"weights file {weights} does not exist") from None
    except IsADirectoryError:
        raise DataError(f"weights {weights} is a directory, not a model.npz file") from None
    except (KeyError, ValueError, OSError) as exc:
        raise UsageError(f"weights {weights} do not fit model {model_name}: {exc}") from None
    return model


def evaluate_weights(model_name: str, weights: str, source: str, tta: bool = False,
                     chunk: int = 1000, data=None) -> dict:
    """``{"test_loss", "test_acc", "n"}`` of the weights on the test split of ``source`` (an
    image source's val split); ``data``: the DataConfig that says how to read it."""
    from pipeline.data import load_dataset
    ds = load_dataset(source, data)
    params = get_state(load_weights(model_name, weights, ds.n_classes))
    spec = tasks.EvalSpec(model_name, ds.n_classes, tta)
    images = ds.test_images.rechunk({0: chunk}).to_delayed().ravel()
    labels = ds.test_labels.rechunk({0: chunk}).to_delayed().ravel()
    token = uuid.uuid4().hex[:8]
    parts = [dask.delayed(tasks.evaluate, pure=True)(params, x, y, spec,
                                                     dask_key_name=(f"evaluate-{token}", i))
             for i, (x, y) in enumerate(zip(images, labels))]
    results = dask.compute(*parts, scheduler="threads")
    n = sum(r["n"] for r in results)
    return dict(test_loss=sum(r["loss_sum"] for r in results) / n,
                test_acc=sum(r["correct"] for r in results) / n, n=n)
