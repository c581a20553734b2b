"""Training strategies end to end on a cluster: equivalences, determinism, resume, outputs."""
import json

import numpy as np
import pytest

from pipeline import Config
from pipeline.backends.chainer.compat import serializers
from pipeline.core.errors import ResumeError, UsageError
from pipeline.backends.chainer.models import build_model
from pipeline.backends.chainer.state import get_state
from pipeline.training.loop import train
from tests.resuming import whole_and_resumed
from tests.helpers import assert_close, assert_same_bits, make_config

SMALL = "synthetic:512:128"


BASE = {"data.source": SMALL, "model.name": "small-cnn", "train.batch_size": 16,
        "train.epochs": 1, "train.lr": 0.01, "augment.policy": "cifar", "progress": False,
        "checkpoint_every": 0, "seed": 3}


def _config(tmp_path=None, **changes) -> Config:
    out = {"out": str(tmp_path)} if tmp_path is not None else {}
    return make_config(BASE, **{**out, **changes})


def test_gradient_equals_single_with_k_times_b(dask_client):
    single = train(_config(**{"train.strategy": "single", "train.replicas": 1,
                              "train.batch_size": 32}), client=dask_client)
    gradient = train(_config(**{"train.strategy": "gradient", "train.replicas": 2}),
                     client=dask_client)
    assert len(gradient.history) == 16 and single.history[-1]["step"] == 16
    assert_close(single.params, gradient.params)


def test_ipm_h1_sgd_equals_gradient(dask_client):
    common = {"train.replicas": 4, "train.batch_size": 8, "train.optimizer": "sgd",
              "train.lr": 0.05, "train.recipe": False}  # plain ipm: the mean of the replicas
    gradient = train(_config(**common, **{"train.strategy": "gradient"}), client=dask_client)
    ipm = train(_config(**common, **{"train.strategy": "ipm", "average.mix_every": "1"}),
                client=dask_client)
    assert_close(gradient.params, ipm.params)


@pytest.mark.slow
def test_weights_identical_on_1_and_3_worker_processes(tmp_path):
    cfg = _config(**{"train.strategy": "ipm", "train.replicas": 3, "average.mix_every": "4",
                     "average.outer_momentum": 0.5, "average.outer_lr": 0.8,
                     "cluster.threads_per_worker": 1})
    one = train(cfg.replace(**{"cluster.workers": 1}))
    three = train(cfg.replace(**{"cluster.workers": 3}))
    assert_same_bits(one.params, three.params)


@pytest.mark.parametrize("strategy, replicas", [("mixture", 2), ("ipm", 2)])
def test_resume_equals_uninterrupted(tmp_path, dask_client, strategy, replicas):
    cfg = _config(**{"train.strategy": strategy, "train.replicas": replicas, "train.epochs": 2,
                     "average.mix_every": "3", "checkpoint_every": 2,
                     "average.optimizer_state": "keep"})
    whole, resumed = whole_and_resumed(cfg, tmp_path, dask_client)
    assert_same_bits(whole.params, resumed.params)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(len(whole.history)))


def test_outputs(tmp_path, dask_client):
    result = train(_config(tmp_path, **{"train.strategy": "ipm", "train.replicas": 2,
                                        "average.mix_every": "1ep", "train.epochs": 2,
                                        "train.recipe": False}),
                   client=dask_client)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[-1]["epoch"] == 1
    for key in ("round", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc",
                "seconds", "stage_seconds", "bytes_averaged"):
        assert key in lines[-1], key
    assert set(lines[-1]["stage_seconds"]) >= {"load", "augment", "train", "average", "evaluate",
                                               "waiting"}
    assert lines[-1]["stage_seconds"]["train"] > 0
    assert lines[-1]["bytes_averaged"] == 2 * sum(v.nbytes for v in result.params.values())
    model = build_model("small-cnn")
    serializers.load_npz(str(tmp_path / "model.npz"), model)  # Chainer alone can read it
    assert_same_bits(get_state(model), result.params)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "config.json").read_text())["train"]["strategy"] == "ipm"


def test_recipe_fills_auto_fields_for_ipm_k_gt_1_only():
    from pipeline.training import strategies
    ipm = strategies.get("ipm").resolve(_config(**{"train.strategy": "ipm", "train.replicas": 4,
                                                   "train.optimizer": "adam", "train.epochs": 20}))
    assert (ipm.train.lr_scaling, ipm.train.warmup_epochs, ipm.average.optimizer_state,
            ipm.average.outer_lr) == ("none", 1.0, "average", 1.0)
    given = strategies.get("ipm").resolve(_config(**{"train.replicas": 4, "train.optimizer": "adam",
                                                     "train.lr_scaling": "sqrt"}))
    assert given.train.lr_scaling == "sqrt" and given.average.optimizer_state == "average"
    sgd = strategies.get("ipm").resolve(_config(**{"train.replicas": 4}))  # momentum: plain
    assert (sgd.train.lr_scaling, sgd.average.optimizer_state) == ("none", "keep")
    off = strategies.get("ipm").resolve(_config(**{"train.replicas": 4, "train.recipe": False}))
    assert (off.average.outer_lr, off.average.optimizer_state, off.train.warmup_epochs) == (
        1.0, "keep", 0.0)
    grad = strategies.get("gradient").resolve(_config(**{"train.replicas": 4}))
    assert grad.average.outer_lr == 1.0 and grad.train.lr_scaling == "none"


@pytest.mark.parametrize("k, optimizer, given, h", [
    (2, "adam", "auto", "10"), (4, "adam", "auto", "10"), (8, "adam", "auto", "1"),
    (16, "adam", "auto", "1"), (8, "momentum", "auto", "10"), (16, "adam", "5", "5")])
def test_recipe_averages_every_step_from_k8(k, optimizer, given, h):
    """H = 1 from IPM.SYNC_FROM_K replicas with Adam (docs/strategies.md, "K = 2 to 16"); H = 10
    below it, without the recipe's optimizer, and for async; an H given by hand wins."""
    from pipeline.training import strategies
    cfg = _config(**{"train.replicas": k, "train.optimizer": optimizer,
                     "average.mix_every": given})
    assert strategies.get("ipm").resolve(cfg).average.mix_every == h
    assert strategies.get("ipm").resolve(cfg.replace(**{"train.recipe": False})
                                         ).average.mix_every == ("10" if given == "auto" else given)
    assert strategies.get("async").resolve(cfg).average.mix_every == ("10" if given == "auto"
                                                                      else given)


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_plain_config_with_k_replicas_resolves_to_the_recipe(k):
    """What a plain ``train`` with K replicas and Adam runs is ``IPM.recipe`` for that K: every
    field the recipe fills, nothing given by hand (the recipe for every K)."""
    from pipeline.training import prepare, strategies
    plain = _config(**{"train.replicas": k, "train.optimizer": "adam"})
    assert plain.train.strategy == "ipm"  # the default strategy
    recipe = strategies.get("ipm").recipe(plain)
    resolved = prepare.normalise(plain)
    assert recipe and {name: getattr(getattr(resolved, name.split(".")[0]), name.split(".")[1])
                       for name in recipe} == recipe


def test_train_with_k16_records_and_runs_the_recipe(tmp_path, dask_client):
    """A plain ``train`` call with 16 replicas writes the recipe's values to config.json, and its
    rounds train at the recipe's rates: a warmup over the first epoch, then lr x its scaling."""
    from pipeline.core.schedule import learning_rate
    from pipeline.training import strategies
    cfg = _config(tmp_path, **{"train.replicas": 16, "train.batch_size": 8, "train.epochs": 2,
                               "train.optimizer": "adam", "train.lr": 1e-3})
    train(cfg, client=dask_client)
    written = json.loads((tmp_path / "config.json").read_text())
    recipe = strategies.get("ipm").recipe(cfg)
    assert {n: written[n.split(".")[0]][n.split(".")[1]] for n in recipe} == recipe
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_epoch = 512 // (16 * 8)  # 4 steps: one round an epoch (rounds never straddle epochs)
    warmup = round(recipe["train.warmup_epochs"] * per_epoch)
    expected = [learning_rate(1e-3, 16, recipe["train.lr_scaling"], warmup, x["step"] - 1)
                for x in lines]
    assert [x["lr"] for x in lines] == pytest.approx(expected)
    assert lines[-1]["lr"] == pytest.approx(1e-3 * {"none": 1, "sqrt": 4, "linear": 16}[
        recipe["train.lr_scaling"]])


def test_existing_run_is_not_overwritten(tmp_path, dask_client):
    cfg = _config(tmp_path, **{"train.strategy": "single", "train.replicas": 1,
                               "train.epochs": 0.25})
    train(cfg, client=dask_client)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(UsageError, match="already holds a run"):
        train(cfg, client=dask_client)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_resume_refuses_a_different_run(tmp_path, dask_client):
    cfg = _config(tmp_path, **{"train.strategy": "single", "train.replicas": 1,
                               "train.epochs": 0.25})
    train(cfg, client=dask_client)
    with pytest.raises(ResumeError, match="train.lr"):
        train(cfg.replace(**{"train.lr": 0.5}), client=dask_client, resume=True)
    with pytest.raises(ResumeError, match="model.name"):
        train(cfg.replace(**{"model.name": "resnet20"}), client=dask_client, resume=True)


def test_divergence_names_round_and_replica(tmp_path, dask_client):
    from pipeline.core.errors import DivergenceError
    cfg = _config(tmp_path, **{"train.strategy": "ipm", "train.replicas": 2, "train.lr": 1e6,
                               "train.optimizer": "sgd", "average.mix_every": "2"})
    with pytest.raises(DivergenceError, match=r"round \d+ .*replica \d"):
        train(cfg, client=dask_client)


@pytest.mark.slow
def test_ipm_k4_matches_single_accuracy(dask_client):
    """Same data, epochs and global batch (single: 32; ipm: 4 replicas x 8, averaged every 4
    steps). Measured here: single 0.579, ipm 0.569 test accuracy after 3 epochs."""
    common = {"data.source": "synthetic", "train.epochs": 3, "train.lr": 0.01,
              "augment.policy": "flip"}
    single = train(_config(**common, **{"train.strategy": "single", "train.replicas": 1,
                                        "train.batch_size": 32}), client=dask_client)
    ipm = train(_config(**common, **{"train.strategy": "ipm", "train.replicas": 4,
                                     "train.batch_size": 8, "average.mix_every": "4"}),
                client=dask_client)
    a, b = single.history[-1]["test_acc"], ipm.history[-1]["test_acc"]
    assert a > 0.4, a  # it learns: chance is 0.1
    assert b >= a - 0.02, (a, b)
