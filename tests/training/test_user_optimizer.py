"""An optimizer the user configures in Python (``train(config, optimizer=...)``), the way Chainer
users write it: a zero-argument factory, or a function that sets it up on the model and adds
hooks. Same bits on 1 and 2 workers and after a resume, the run's learning-rate schedule still
applies (the same bits as the optimizer by name), the hooks act, bad factories are one line."""
from __future__ import annotations

import json
import textwrap

import pytest

from pipeline.core.errors import UsageError
from pipeline.training.loop import train
from tests.helpers import assert_same_bits, make_config, same_bits, user_code

MODULE = textwrap.dedent('''
    """A user's model and optimizers, plain Chainer."""
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from chainer import optimizer_hooks


    def net(n_classes=10):
        return chainer.Sequential(L.Convolution2D(None, 4, 3, pad=1), F.relu,
                                  lambda x: F.max_pooling_2d(x, 4), L.Linear(None, n_classes))


    def momentum():
        return chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9)


    def hooked(link):
        opt = chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9)
        opt.setup(link)
        opt.add_hook(optimizer_hooks.WeightDecay(0.05))
        opt.add_hook(optimizer_hooks.GradientClipping(0.5))
        return opt


    def unset(link):
        return chainer.optimizers.SGD()


    def two(link, other):
        return chainer.optimizers.SGD()


    def not_one():
        return 3
''')

BASE = {"data.source": "synthetic:96:24", "train.batch_size": 8, "train.epochs": 1,
        "progress": False, "checkpoint_every": 0, "seed": 3, "train.strategy": "ipm",
        "train.replicas": 2, "average.mix_every": "3"}


@pytest.fixture(scope="module")
def useropts(tmp_path_factory):
    """``useropts`` in a directory outside the repository, put on sys.path."""
    with user_code(tmp_path_factory.mktemp("useropts"), "useropts", MODULE) as module:
        yield module


@pytest.fixture(scope="module")
def one_worker():
    import distributed
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        yield client


def test_hooks_act_and_give_the_same_bits_on_1_and_2_workers(useropts, dask_client, one_worker):
    cfg = make_config(BASE)
    two = train(cfg, client=dask_client, model=useropts.net, optimizer=useropts.hooked)
    one = train(cfg, client=one_worker, model=useropts.net, optimizer=useropts.hooked)
    assert_same_bits(two.params, one.params)
    assert two.config.train.optimizer == "useropts:hooked"
    assert two.config.train.lr == 0.05  # the factory's rate, the base of the schedule
    unhooked = train(cfg, client=dask_client, model=useropts.net, optimizer=useropts.momentum)
    assert not same_bits(two.params, unhooked.params)  # weight decay and clipping acted
    decayed = sum(float((v.astype("float64") ** 2).sum()) for k, v in two.params.items()
                  if k.endswith("/W"))
    free = sum(float((v.astype("float64") ** 2).sum()) for k, v in unhooked.params.items()
               if k.endswith("/W"))
    assert decayed < free


def test_a_zero_argument_factory_follows_the_runs_schedule(useropts, dask_client):
    """``lambda: MomentumSGD(lr=0.05, momentum=0.9)`` under warmup and cosine decay: the same
    bits as the optimizer by name with that lr, so each step's lr came from the schedule."""
    cfg = make_config(BASE, **{"train.warmup_epochs": 0.5, "train.lr_decay": "cosine",
                               "train.lr_scaling": "sqrt"})
    mine = train(cfg, client=dask_client, model=useropts.net, optimizer=useropts.momentum)
    named = train(cfg.replace(**{"train.optimizer": "momentum", "train.lr": 0.05,
                                 "train.momentum": 0.9}),
                  client=dask_client, model=useropts.net)
    assert_same_bits(mine.params, named.params)


class _Stop(Exception):
    pass


def test_interrupted_and_resumed_equals_uninterrupted(useropts, dask_client, tmp_path):
    cfg = make_config(BASE, **{"train.epochs": 2, "checkpoint_every": 1,
                               "average.optimizer_state": "average"})
    whole = train(cfg.replace(out=str(tmp_path / "whole")), client=dask_client,
                  model=useropts.net, optimizer=useropts.hooked)
    recorded = json.loads((tmp_path / "whole" / "config.json").read_text())["train"]
    assert (recorded["optimizer"], recorded["lr"]) == ("useropts:hooked", 0.05)

    def stop(line):
        if line["round"] == 1:
            raise _Stop

    cut = cfg.replace(out=str(tmp_path / "cut"))
    with pytest.raises(_Stop):
        train(cut, client=dask_client, model=useropts.net, optimizer=useropts.hooked,
              on_round=stop)
    from pipeline.core import npz
    from pipeline.outputs.fs import checkpoint_dirs
    state = npz.read(checkpoint_dirs(tmp_path / "cut" / "checkpoints")[-1][1] / "state.npz")
    assert any(k.endswith("/v") for k in state), sorted(state)[:10]  # momentum slots travel
    saved = cut.replace(**{"train.optimizer": "useropts:hooked"})  # as config.json says
    with pytest.raises(UsageError, match="this run's optimizer is your own code"):
        train(saved, client=dask_client, model=useropts.net, resume=True)
    resumed = train(saved, client=dask_client, model=useropts.net,
                    optimizer="useropts:hooked", resume=True)
    assert_same_bits(whole.params, resumed.params)
    from pipeline.training.recovery import resume_command
    assert resume_command(tmp_path / "cut").endswith("--optimizer useropts:hooked")


def test_bad_factories_are_one_line_before_any_cluster(useropts):
    cfg = make_config(BASE)
    cases = [(len, "built-in function"), (json.loads, "standard library"),
             (useropts.unset, "not set up on the model"), (useropts.two, "takes 2 arguments"),
             (useropts.not_one, "returned int, not a chainer.Optimizer"),
             ("useropts:nothing", "useropts has no nothing"),
             ("os.path", "neither an optimizer name nor an import path")]
    for factory, match in cases:
        with pytest.raises(UsageError, match=match):
            train(cfg, client="no cluster", model=useropts.net, optimizer=factory)
    with pytest.raises(UsageError, match="train.weight_decay is for an optimizer by name"):
        train(cfg.replace(**{"train.weight_decay": 1e-4}), client="no cluster",
              model=useropts.net, optimizer=useropts.hooked)
