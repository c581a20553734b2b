"""A model of the user's, written with stock Chainer links in a module outside the repository:
every strategy trains it, its dropout and lazily sized layer are seeded from the run seed
(1 vs 3 workers, interrupted + resumed), frozen layers stay put, BatchNorm statistics are
state; any Chainer optimizer by name; models written as Chainer users write them (Sequential,
ChainList, lambda layers) with their own optimizer; starting weights from a file."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from pipeline.core.errors import UsageError
from pipeline.training.loop import train
from tests.helpers import assert_same_bits, make_config, user_code

MODULE = textwrap.dedent('''
    """A user's model: stock links only (BatchNorm, dropout, a lazily sized Linear)."""
    from pipeline.backends.chainer.compat import chainer
    import chainer.functions as F
    import chainer.links as L
    from pipeline.backends.chainer.user_models import freeze


    class Net(chainer.Chain):
        def __init__(self, n_classes=10, width=8, frozen=False):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, width, 3, pad=1)
                self.bn = L.BatchNormalization(width)
                self.fc = L.Linear(None, n_classes)
            if frozen:
                freeze(self.conv)

        def forward(self, x):
            h = F.relu(self.bn(self.conv(x)))
            h = F.dropout(F.max_pooling_2d(h, 4), 0.3)
            return self.fc(h)


    def sequential(n_classes=10):
        """Lazily sized links, functions and lambda layers in a chainer.Sequential."""
        return chainer.Sequential(
            L.Convolution2D(None, 4, 3, pad=1), F.relu, lambda x: F.max_pooling_2d(x, 2),
            L.Convolution2D(None, 4, 3, pad=1), L.BatchNormalization(4), F.relu,
            lambda x: F.dropout(x, 0.3), L.Linear(None, n_classes))


    class Block(chainer.Chain):
        def __init__(self, width):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(None, width, 3, pad=1)
                self.bn = L.BatchNormalization(width)

        def forward(self, x):
            return F.relu(x + self.bn(self.conv(x)))


    class Residual(chainer.ChainList):
        """A ChainList of residual blocks between a lazily sized stem and head."""
        def __init__(self, n_classes=10, width=4, blocks=2):
            super().__init__(L.Convolution2D(None, width, 3, pad=1),
                             *[Block(width) for _ in range(blocks)], L.Linear(None, n_classes))

        def forward(self, x):
            h = F.max_pooling_2d(self[0](x), 4)
            for block in self[1:-1]:
                h = block(h)
            return self[-1](F.dropout(h, 0.3))


    def hooked(link):
        """The optimizer the Chainer way: set up on the model, then hooks."""
        opt = chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9)
        opt.setup(link)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-3))
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(1.0))
        return opt
''')

BASE = {"data.source": "synthetic:240:60", "train.batch_size": 20, "train.epochs": 1,
        "train.lr": 0.02, "progress": False, "checkpoint_every": 0, "seed": 5,
        "average.mix_every": "3", "model.args": '{"width": 4}'}


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """``usernets.Net`` in a directory outside the repository, put on sys.path."""
    with user_code(tmp_path_factory.mktemp("usercode"), "usernets", MODULE) as module:
        yield module


@pytest.mark.parametrize("strategy, replicas", [("single", 1), ("gradient", 2), ("mixture", 2),
                                                ("ipm", 2), ("async", 2)])
def test_every_strategy_trains_it_and_keeps_frozen_layers(user_module, dask_client, strategy,
                                                           replicas):
    cfg = make_config(BASE, **{"train.strategy": strategy, "train.replicas": replicas,
                               "model.args": '{"width": 4, "frozen": true}'})
    result = train(cfg, client=dask_client, model=user_module.Net)
    assert result.config.model.name == "usernets:Net"
    from pipeline.backends import get_backend
    initial = get_backend().init_params(_ref(cfg, user_module.Net), 10, cfg.seed)
    assert initial.keys() == result.params.keys()
    for key in ("conv/W", "conv/b"):  # frozen: untouched by every strategy
        assert initial[key].tobytes() == result.params[key].tobytes(), key
    for key in ("fc/W", "bn/gamma", "bn/avg_mean"):  # trained, BatchNorm statistics included
        assert initial[key].tobytes() != result.params[key].tobytes(), key
    assert np.isfinite(result.history[-1]["train_loss"])
    assert isinstance(result.model, user_module.Net)


def test_a_model_object_stands_for_its_class(user_module, dask_client):
    """``model=Net()`` (an object, as PyTorch users pass one) trains as ``model=Net`` does: each
    replica builds its own from model.args and the run seed, the same bits."""
    cfg = make_config(BASE, **{"train.strategy": "single", "train.replicas": 1,
                               "train.epochs": 0.5})
    by_class = train(cfg, client=dask_client, model=user_module.Net)
    by_object = train(cfg, client=dask_client, model=user_module.Net(width=4))
    assert by_object.config.model.name == "usernets:Net"
    assert_same_bits(by_class.params, by_object.params)


def _ref(cfg, factory):
    from pipeline.backends import get_backend
    return get_backend().resolve_model("usernets:Net", cfg.model.args, factory, (32, 32), 10)


def test_dropout_is_seeded_by_round_and_replica_on_1_and_3_workers(user_module):
    import distributed
    cfg = make_config(BASE, **{"train.strategy": "ipm", "train.replicas": 3})
    results = []
    for workers in (1, 3):
        with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                                      dashboard_address="127.0.0.1:0") as cluster, \
                distributed.Client(cluster, set_as_default=False) as client:
            results.append(train(cfg, client=client, model=user_module.Net))
    assert_same_bits(results[0].params, results[1].params)
    again = None
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        again = train(cfg, client=client, model=user_module.Net)  # two tasks per worker at once
    assert_same_bits(results[0].params, again.params)


class _Stop(Exception):
    pass


def test_interrupted_and_resumed_equals_uninterrupted(user_module, dask_client, tmp_path):
    cfg = make_config(BASE, **{"train.strategy": "ipm", "train.replicas": 2, "train.epochs": 2,
                               "checkpoint_every": 1, "average.optimizer_state": "keep"})
    whole = train(cfg.replace(out=str(tmp_path / "whole")), client=dask_client,
                  model=user_module.Net)

    def stop(line):
        if line["round"] == 1:
            raise _Stop

    cut = cfg.replace(out=str(tmp_path / "cut"))
    with pytest.raises(_Stop):
        train(cut, client=dask_client, model=user_module.Net, on_round=stop)
    with pytest.raises(UsageError, match="this run's model is your own code"):
        train(cut.replace(**{"model.name": "usernets:Net"}), client=dask_client, resume=True)
    resumed = train(cut, client=dask_client, resume=True, model="usernets:Net")
    assert_same_bits(whole.params, resumed.params)

    from pipeline import load_model
    with pytest.raises(UsageError, match="name it again"):
        load_model(tmp_path / "whole")
    model = load_model(tmp_path / "whole", model=user_module.Net)
    from pipeline.backends.chainer.state import get_state
    assert_same_bits(get_state(model), whole.params)


@pytest.mark.parametrize("factory", ["sequential", "Residual"])
def test_chainer_style_models_with_their_optimizer_on_1_and_2_workers_and_resumed(
        user_module, dask_client, tmp_path, factory):
    """A Sequential with lambda layers and a ChainList of residual blocks, lazily sized, with
    dropout and BatchNorm, trained by ipm with an optimizer set up the Chainer way (hooks
    added after setup): the same bits on 1 and 2 workers, and interrupted + resumed."""
    import distributed
    cfg = make_config(BASE, **{"data.source": "synthetic:96:24", "train.batch_size": 8,
                               "train.strategy": "ipm", "train.replicas": 2, "train.epochs": 2,
                               "model.args": "{}", "checkpoint_every": 1,
                               "average.optimizer_state": "average"})
    build, opt = getattr(user_module, factory), user_module.hooked
    whole = train(cfg.replace(out=str(tmp_path / "whole")), client=dask_client, model=build,
                  optimizer=opt)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        one = train(cfg, client=client, model=build, optimizer=opt)
    assert_same_bits(whole.params, one.params)

    def stop(line):
        if line["round"] == 1:
            raise _Stop

    cut = cfg.replace(out=str(tmp_path / "cut"))
    with pytest.raises(_Stop):
        train(cut, client=dask_client, model=build, optimizer=opt, on_round=stop)
    resumed = train(cut, client=dask_client, resume=True, model=f"usernets:{factory}",
                    optimizer="usernets:hooked")
    assert_same_bits(whole.params, resumed.params)


@pytest.mark.parametrize("optimizer, args", [("RMSprop", '{"alpha": 0.9}'), ("AdaGrad", '{}'),
                                             ("AdamW", '{"weight_decay_rate": 0.01}')])
def test_any_chainer_optimizer_with_its_state_averaged(user_module, dask_client, tmp_path,
                                                       optimizer, args):
    cfg = make_config(BASE, **{"train.strategy": "ipm", "train.replicas": 2,
                               "train.optimizer": optimizer, "train.optimizer_args": args,
                               "train.lr": 0.001, "train.weight_decay": 1e-4,
                               "train.grad_clip": 1.0, "average.optimizer_state": "average",
                               "checkpoint_every": 1, "out": str(tmp_path)})
    result = train(cfg, client=dask_client, model=user_module.Net)
    assert np.isfinite(result.history[-1]["train_loss"])
    from pipeline.outputs.fs import checkpoint_dirs
    from pipeline.core import npz
    state = npz.read(checkpoint_dirs(tmp_path / "checkpoints")[-1][1] / "state.npz")
    slots = {k.rsplit("/", 1)[-1] for k in state if "/opt/" in k or k.startswith("opt/")}
    assert slots, sorted(state)[:10]


def test_a_bad_optimizer_or_its_arguments_is_one_line(user_module, dask_client):
    for changes, match in (({"train.optimizer": "NoSuch"}, "train.optimizer"),
                           ({"train.optimizer": "RMSprop", "train.optimizer_args": '{"lr": 1}'},
                            "--lr"),
                           ({"train.optimizer": "RMSprop", "train.optimizer_args": '{"x": 1}'},
                            "optimizer_args")):
        with pytest.raises((UsageError, ValueError), match=match):
            train(make_config(BASE, **changes), client=dask_client, model=user_module.Net)


def test_init_weights_are_checked_and_used(user_module, dask_client, tmp_path):
    cfg = make_config(BASE, **{"train.strategy": "single", "train.replicas": 1,
                               "out": str(tmp_path / "a")})
    first = train(cfg, client=dask_client, model=user_module.Net)
    weights = str(tmp_path / "a" / "model.npz")
    tuned = make_config(BASE, **{"train.strategy": "single", "train.replicas": 1,
                                 "train.lr": 1e-9, "train.optimizer": "sgd",
                                 "model.init_weights": weights})
    again = train(tuned, client=dask_client, model=user_module.Net)
    np.testing.assert_allclose(again.params["fc/W"], first.params["fc/W"], atol=1e-6)
    wide = tuned.replace(**{"model.args": '{"width": 8}'})
    with pytest.raises(UsageError, match=r"--init-weights .* does not fit model usernets:Net"):
        train(wide, client=dask_client, model=user_module.Net)


@pytest.mark.cluster
def test_a_worker_lost_mid_round_on_an_external_cluster_replays_to_the_same_bits(user_module,
                                                                                  dask_client):
    """Workers started by hand (`dask worker` processes) that cannot import usernets: the
    factory travels by value; one of them is killed mid-round and the replay gives the
    uninterrupted run's weights."""
    from tests.clusters import subprocess_cluster
    from tests.clusters import Killer
    cfg = make_config(BASE, **{"train.strategy": "ipm", "train.replicas": 3,
                               "average.mix_every": "2", "train.epochs": 3,
                               "cluster.connect_timeout": 5.0})
    reference = train(cfg, client=dask_client, model=user_module.Net).params
    with subprocess_cluster(3, resources={"CPU": 1}) as cluster:
        killer = Killer(cluster, {1: 1})
        try:
            result = train(cfg.replace(**{"cluster.scheduler": cluster.address}),
                           model=user_module.Net, on_round=killer, log=lambda line: None)
        finally:
            killer.close()
        assert [k[0] for k in killer.killed] == [1], (killer.killed, cluster.logs())
    assert_same_bits(reference, result.params)


def test_bf16_reaches_a_model_of_stock_links_with_the_same_bits_on_1_and_2_workers(
        user_module, dask_client):
    """``--precision bf16`` rounds a user's ``L.Convolution2D`` and ``L.Linear`` inputs as it
    does ours (the stock dispatchers), and keeps the guarantees: the same bits on one and two
    workers; close to the fp32 run."""
    import distributed
    from pipeline.backends.chainer.cpu_kernels import dnnl, onednn
    from pipeline.core import precision
    if onednn.load() is None or precision.bf16_support(precision.cpu_flags()) is not None:
        pytest.skip("bf16 needs oneDNN and a CPU with amx_bf16 or avx512_bf16")
    cfg = make_config(BASE, **{"train.strategy": "ipm", "train.replicas": 2,
                               "train.precision": "bf16"})
    before = dnnl.stats["bf16_calls"]
    two = train(cfg, client=dask_client, model=user_module.Net)
    assert dnnl.stats["bf16_calls"] > before  # in-process workers: their calls count here
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        one = train(cfg, client=client, model=user_module.Net)
    assert_same_bits(one.params, two.params)
    fp32 = train(cfg.replace(**{"train.precision": "fp32"}), client=dask_client,
                 model=user_module.Net)
    assert not np.array_equal(fp32.params["fc/W"], two.params["fc/W"])
    loss_bf16, loss_fp32 = two.history[-1]["train_loss"], fp32.history[-1]["train_loss"]
    assert abs(loss_bf16 - loss_fp32) / loss_fp32 < 0.02  # tests/training/test_bf16_training.py
