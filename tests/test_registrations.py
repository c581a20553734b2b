"""A new reader, averaging algorithm or strategy is its module plus one registry line: each is
registered here at run time (nothing else edited) and a run goes through it, end to end. The
backend's twin is tests/backends/test_toy_backend.py."""
from __future__ import annotations

import json

import numpy as np

import pipeline
from pipeline.averaging import algorithms
from pipeline.averaging.algorithms import tree
from pipeline.cli.parser import main
from pipeline.data import datasets
from pipeline.data.readers import Reader
from tests.helpers import assert_same_bits

BASE = {"train.batch_size": 8, "train.epochs": 1, "augment.policy": "flip", "progress": False,
        "average.mix_every": "2", "train.replicas": 2}


def _toy_plan(source, cfg, download=False, client=None):
    n, m = (int(x) for x in str(source).split(":")[1:])
    return datasets._synthetic_plan(n, m, seed=7)._replace(ident=("toy", n, m),
                                                           source=str(source))


TOY_READER = Reader("toy", lambda source, cfg: str(source).startswith("toy:"), _toy_plan,
                    checks_on_driver=True, image_side=32, eval_split="test")


def test_a_registered_reader_trains_records_and_reads_back(monkeypatch, dask_client, tmp_path,
                                                          capsys):
    monkeypatch.setattr(datasets, "READERS", (TOY_READER, *datasets.READERS))  # the one line
    config = pipeline.Config().replace(**{**BASE, "data.source": "toy:64:16",
                                          "out": str(tmp_path)})
    pipeline.train(config, dask_client, log=lambda m: None)
    assert json.loads((tmp_path / "config.json").read_text())["data"]["dataset"] == "toy"
    assert json.loads((tmp_path / "data.json").read_text())["kind"] == "toy"
    assert pipeline.predict(tmp_path, np.zeros((2, 3, 32, 32), np.uint8)).proba.shape == (2, 10)
    capsys.readouterr()
    assert main(["evaluate", "--run", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 16


def test_a_registered_averaging_algorithm_averages_to_the_same_bits(monkeypatch, dask_client):
    monkeypatch.setitem(algorithms.ALGORITHMS, "toy", tree)  # the one line (tree's body, a new name)
    config = pipeline.Config().replace(**{**BASE, "data.source": "synthetic:64:16"})
    by_tree = pipeline.train(config.replace(**{"average.algorithm": "tree"}), dask_client,
                             log=lambda m: None)
    by_toy = pipeline.train(config.replace(**{"average.algorithm": "toy"}), dask_client,
                            log=lambda m: None)
    assert_same_bits(by_tree.params, by_toy.params)


def test_a_registered_strategy_runs(monkeypatch, dask_client):
    from pipeline.training import strategies
    monkeypatch.setitem(strategies.REGISTRY, "plain-mixture",
                        "tests.test_registrations:PlainMixture")  # the one line
    config = pipeline.Config().replace(**{**BASE, "data.source": "synthetic:64:16",
                                          "train.strategy": "plain-mixture"})
    result = pipeline.train(config, dask_client, log=lambda m: None)
    reference = pipeline.train(config.replace(**{"train.strategy": "mixture"}), dask_client,
                               log=lambda m: None)
    assert_same_bits(result.params, reference.params)


def _mixture():
    from pipeline.training.strategies.mixture import Mixture
    return Mixture


class PlainMixture(_mixture()):
    """``mixture`` under another name: a strategy module's whole body can be this small."""
    name = "plain-mixture"

