"""A new framework is its module plus one line in ``BACKENDS``: a toy NumPy backend registered
here trains every strategy's rounds, evaluates, checkpoints, resumes and predicts through the
same loop, chosen by the config field ``model.backend`` alone."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pipeline
from pipeline.backends import BACKENDS
from tests.helpers import assert_same_bits

BASE = {"model.backend": "toy", "model.name": "toy-linear", "data.source": "synthetic:96:24",
        "train.batch_size": 8, "train.epochs": 1, "train.lr": 0.5, "augment.policy": "flip",
        "average.mix_every": "2", "progress": False, "checkpoint_every": 1}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(BACKENDS, "toy", "tests.backends.toy_backend")  # the one line


@pytest.mark.parametrize("strategy, replicas", [("single", 1), ("ipm", 2), ("gradient", 2),
                                                ("async", 2)])
def test_a_registered_backend_runs_the_rounds(toy, dask_client, tmp_path, strategy, replicas):
    config = pipeline.Config().replace(**{**BASE, "train.strategy": strategy,
                                          "train.replicas": replicas, "out": str(tmp_path)})
    result = pipeline.train(config, dask_client, log=lambda m: None)
    assert sorted(result.params) == ["W", "b"] and result.params["W"].shape == (3, 10)
    assert result.history and "test_acc" in result.history[-1]
    assert json.loads((tmp_path / "config.json").read_text())["model"]["backend"] == "toy"
    proba = pipeline.predict(tmp_path, np.zeros((2, 3, 32, 32), np.uint8)).proba
    assert proba.shape == (2, 10) and np.allclose(proba.sum(axis=1), 1)


def test_its_runs_resume_to_the_same_bits(toy, dask_client, tmp_path):
    config = pipeline.Config().replace(**{**BASE, "train.strategy": "ipm", "train.replicas": 2,
                                          "train.epochs": 2, "out": str(tmp_path / "whole")})
    whole = pipeline.train(config, dask_client, log=lambda m: None)
    half = config.replace(**{"train.epochs": 1, "out": str(tmp_path / "parts")})
    pipeline.train(half, dask_client, log=lambda m: None)
    resumed = pipeline.train(half.replace(**{"train.epochs": 2}), dask_client, resume=True,
                             log=lambda m: None)
    assert_same_bits(whole.params, resumed.params)


def test_an_unregistered_backend_is_one_line(capsys, tmp_path):
    from tests.helpers import assert_one_error_line
    from pipeline.cli.parser import main
    assert main(["train", "--backend", "jax", "--no-progress", "--out", str(tmp_path)]) == 2
    line = assert_one_error_line(capsys.readouterr().err, before=None)
    assert "model.backend must be one of ['chainer'], got 'jax'" in line
