"""Data-parallel training of Chainer models as Dask task graphs.

Notebook use::

    from pipeline import Config, train
    result = train(Config().replace(**{"train.strategy": "ipm", "train.replicas": 4}))
"""
from pipeline import _moved
from pipeline.core.config import (AugmentConfig, AverageConfig, ClusterConfig, Config, DataConfig,
                                  ModelConfig, TrainConfig)

_moved.install()  # the module paths from before the packages (pipeline/_moved.py)


def train(config, client=None, **kwargs):
    """Run training; see pipeline.training.loop.train."""
    from pipeline.training.loop import train as _train
    return _train(config, client=client, **kwargs)


def load_model(out, model=None):
    """The trained model of a run directory; see pipeline.training.evaluate.load_model."""
    from pipeline.training.evaluate import load_model as _load_model
    return _load_model(out, model)


def predict(run_or_model, images, **kwargs):
    """Class probabilities and names of images under a trained run; see
    pipeline.training.predict.predict."""
    from pipeline.training.predict import predict as _predict
    return _predict(run_or_model, images, **kwargs)


def export(run_or_model, path, **kwargs):
    """Write a trained run's network as an ONNX file; see pipeline.training.export.export."""
    from pipeline.training.export import export as _export
    return _export(run_or_model, path, **kwargs)


__all__ = ["Config", "DataConfig", "AugmentConfig", "ModelConfig", "TrainConfig", "AverageConfig",
           "ClusterConfig", "train", "load_model", "predict",
           "export"]
