"""Data-parallel training of Chainer models as Dask task graphs.

Notebook use::

    from pipeline import Config, train
    result = train(Config().replace(**{"train.strategy": "ipm", "train.replicas": 4}))
"""
from pipeline.config import (AugmentConfig, AverageConfig, ClusterConfig, Config, DataConfig,
                             ModelConfig, TrainConfig)


def train(config, client=None, **kwargs):
    """Run training; see pipeline.training.train."""
    from pipeline.training import train as _train
    return _train(config, client=client, **kwargs)


def load_model(out):
    """The trained model of a run directory; see pipeline.evaluation.load_model."""
    from pipeline.evaluation import load_model as _load_model
    return _load_model(out)


__all__ = ["Config", "DataConfig", "AugmentConfig", "ModelConfig", "TrainConfig", "AverageConfig",
           "ClusterConfig", "train", "load_model"]
