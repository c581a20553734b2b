"""A net of Chainer's stock links and functions on our kernels (``cpu_kernels.stock``): same values as Chainer's, same bits for ours."""
import numpy as np
import pytest

from pipeline.backends.chainer.compat import F, L, chainer
from pipeline.backends.chainer.cpu_kernels import functions as K, stock
from pipeline.backends.chainer.models import build_model


@pytest.fixture
def installed():
    """The dispatchers installed for the test; afterwards the state it found."""
    was = stock.installed()
    stock.install()
    yield
    if not was:
        stock.uninstall()


class StockNet(chainer.Chain):
    """Every dispatched function through Chainer's own links and ``F.*``, lazily sized layers included."""

    def __init__(self):  # parameters of chainer.config.dtype
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1)
            self.b1 = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(None, 12, 3, stride=2, pad=1, nobias=True)
            self.b2 = L.BatchNormalization(12)
            self.fc = L.Linear(None, 5)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.b1(self.c1(x))), 3, stride=2)  # overlapping, cover_all
        h = F.relu(self.b2(self.c2(h)))
        h = F.concat([F.average_pooling_2d(h, 2), F.max_pooling_2d(h, 2)])
        h = F.concat([F.reshape(h, (len(h), -1)),
                      F.reshape(F.spatial_pyramid_pooling_2d(h, 2, pooling="max"), (len(h), -1))])
        return self.fc(F.dropout(h, 0.5))


def _creators(y):
    """Classes of every FunctionNode in y's graph."""
    seen, todo = set(), [y.creator_node]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield type(node)
        todo.extend(v.creator_node for v in node.inputs)


def _persistent(net):
    """Every persistent array (BatchNorm's statistics) by path, copied."""
    return {f"{path}/{name}": np.array(getattr(link, name)) for path, link in net.namedlinks()
            for name in sorted(link._persistent)}


def _train_step(kernels, dtype=np.float32, seed=0):
    """One forward/backward of StockNet -> (loss, logits, grads, BN statistics, node classes)."""
    np.random.seed(seed)  # Chainer's initializers and F.dropout draw from NumPy's global RNG
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 3, 15, 15)).astype(dtype)
    t = rng.integers(0, 5, 6).astype(np.int32)
    with chainer.using_config("cpu_kernels", kernels), chainer.using_config("dtype", dtype):
        net = StockNet()
        net(x[:1])  # materialise the lazy layers (same draws on both sides)
        net.cleargrads()
        for link in (net.b1, net.b2):
            link.avg_mean[...] = 0
            link.avg_var[...] = 1
        logits = net(x)
        loss = F.softmax_cross_entropy(logits, t)
        loss.backward()
        with chainer.using_config("train", False), chainer.no_backprop_mode():
            inference = net(x).array
    grads = {path: p.grad for path, p in net.namedparams()}
    stats = _persistent(net)
    return loss.array, logits.array, inference, grads, stats, set(_creators(loss))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (np.float64, 1e-10)])
def test_stock_net_matches_chainer(installed, dtype, tol):
    ref, ours = _train_step("chainer", dtype), _train_step("ours", dtype)
    for a, b in zip(ours[:3], ref[:3]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    for got, want in ((ours[3], ref[3]), (ours[4], ref[4])):
        assert got.keys() == want.keys()
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=tol, atol=tol, err_msg=path)
    ours_nodes = {K.Convolution2D, K.BatchNormalization, K.MaxPooling2D, K.AveragePooling2D}
    assert ours_nodes <= ours[5]
    assert not ours_nodes & ref[5]


def test_uninstalled_stock_net_runs_chainers_functions():
    was = stock.installed()
    stock.uninstall()
    try:
        nodes = _train_step("ours")[5]
        assert not {K.Convolution2D, K.BatchNormalization, K.MaxPooling2D} & nodes
    finally:
        if was:
            stock.install()


def _node(y):
    return type(y.creator)


def test_fallbacks_give_chainers_nodes(installed):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    w = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    gamma, beta = np.ones(2, np.float32), np.zeros(2, np.float32)
    theirs = [
        F.convolution_2d(x, w, cover_all=True),
        F.convolution_2d(x, w, dilate=2),
        F.convolution_2d(x, w[:, :1], groups=2),
        F.convolution_2d(x.astype(np.float16), w.astype(np.float16)),
        F.max_pooling_2d(x, 2, return_indices=True)[0],
        F.batch_normalization(x[:, :, 0], gamma, beta),  # 3-D input
        F.batch_normalization(x, np.ones((2, 6), np.float32), np.zeros((2, 6), np.float32),
                              axis=(0, 3)),  # other axes
        F.fixed_batch_normalization(x, gamma, beta, beta, gamma),  # a graph is being built
    ]
    with chainer.using_config("cpu_kernels", "chainer"):
        theirs.append(F.max_pooling_2d(x, 2))
        theirs.append(F.convolution_2d(x, w))
    for y in theirs:
        assert not _node(y).__module__.endswith("cpu_kernels.functions"), _node(y)
    ours = [F.convolution_2d(x, w, pad=1), F.max_pooling_2d(x, 3, 2), F.average_pooling_2d(x, 2),
            F.batch_normalization(x, gamma, beta)]
    for y in ours:
        assert _node(y).__module__.endswith("cpu_kernels.functions"), _node(y)
    with chainer.no_backprop_mode():  # no graph, no node: ours hands back channels-last memory
        y = F.fixed_batch_normalization(x, gamma, beta, beta, gamma).array
    assert y.transpose(0, 2, 3, 1).flags.c_contiguous and not y.flags.c_contiguous


def test_link_calls_reach_the_dispatchers(installed):
    """``L.Convolution2D`` calls through its module's name, ``L.BatchNormalization`` through ``F``."""
    x = np.random.default_rng(2).standard_normal((2, 3, 5, 5)).astype(np.float32)
    with chainer.using_config("train", True):
        assert _node(L.Convolution2D(3, 4, 3)(x)) is K.Convolution2D
        assert _node(L.BatchNormalization(3)(x)) is K.BatchNormalization


def test_install_is_idempotent_and_reversible():
    was = stock.installed()
    try:
        stock.install()
        stock.install()
        assert F.max_pooling_2d is stock.max_pooling_2d
        stock.uninstall()
        assert F.max_pooling_2d is stock.ORIGINAL["max_pooling_2d"]
        assert not stock.installed()
    finally:
        (stock.install if was else stock.uninstall)()


def test_the_backend_installs_the_dispatchers_when_it_builds_a_replica():
    from pipeline.backends.chainer import backend
    was = stock.installed()
    stock.uninstall()
    try:
        backend.BACKEND.to_model("small-cnn", 10, backend.BACKEND.init_params("small-cnn", 10, 0))
        assert stock.installed()
    finally:
        (stock.install if was else stock.uninstall)()


def _our_net_step(name):
    """One Adam step of a shipped net on our kernels -> every array of its state and the loss."""
    model = build_model(name, 10, seed=3)
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 3, 32, 32)).astype(np.float32)
    t = rng.integers(0, 10, 8).astype(np.int32)
    with chainer.using_config("train", True), chainer.using_config("cpu_kernels", "ours"):
        loss = F.softmax_cross_entropy(model(x, rng=np.random.default_rng(3)), t)
        model.cleargrads()
        loss.backward()
        optimizer.update()
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        probs = model(x).array
    state = _persistent(model)
    state.update({path: p.array.copy() for path, p in model.namedparams()})
    return loss.array, probs, state


@pytest.mark.parametrize("name", ["small-cnn", "resnet20", "cifar10-2015"])
def test_our_nets_give_the_same_bits_with_the_dispatchers_installed(name):
    was = stock.installed()
    try:
        stock.uninstall()
        before = _our_net_step(name)
        stock.install()
        after = _our_net_step(name)
    finally:
        (stock.install if was else stock.uninstall)()
    assert before[0].tobytes() == after[0].tobytes()
    assert before[1].tobytes() == after[1].tobytes()
    assert before[2].keys() == after[2].keys()
    for path in before[2]:
        assert before[2][path].tobytes() == after[2][path].tobytes(), path


# ---- Adam by slices (cpu_kernels.optimizers) ------------------------------------------------

def _adam_run(shape, dtype, kwargs, alpha=None, transpose=False, steps=3):
    """A few Adam steps on one parameter -> (parameter bytes, m bytes, v bytes)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal(shape).astype(dtype)
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(w.T if transpose else w)
    optimizer = chainer.optimizers.Adam(**kwargs)
    optimizer.setup(link)
    for step in range(steps):
        if alpha is not None:
            optimizer.alpha = alpha  # as the backend's set_lr does, possibly a NumPy scalar
        g = rng.standard_normal(shape).astype(dtype) * (step + 1)
        link.w.grad = g.T if transpose else g
        optimizer.update()
    state = link.w.update_rule.state
    return [np.asarray(a).tobytes() for a in (link.w.array, state["m"], state["v"])]


@pytest.mark.parametrize("shape, dtype, kwargs, alpha, transpose", [
    ((1000, 37), np.float32, {}, None, False),  # several slices, the last one short
    ((1000, 37), np.float32, {}, np.float64(3e-3), False),  # a float64 scalar: float64 steps
    ((5,), np.float64, {"weight_decay_rate": 0.1, "eta": 0.5}, 2e-3, False),
    ((300, 41), np.float32, {"amsgrad": True}, None, False),  # Chainer's own
    ((300, 41), np.float32, {}, None, True),  # not C-contiguous: Chainer's own
])
def test_adam_by_slices_gives_chainers_bits(monkeypatch, shape, dtype, kwargs, alpha, transpose):
    from pipeline.backends.chainer.cpu_kernels import optimizers
    monkeypatch.setattr(optimizers, "CHUNK", 4096)
    chainers = []
    original = optimizers.ORIGINAL
    monkeypatch.setattr(optimizers, "ORIGINAL", lambda *a: chainers.append(1) or original(*a))
    was = stock.installed()
    try:
        stock.uninstall()
        theirs = _adam_run(shape, dtype, kwargs, alpha, transpose)
        stock.install()
        chainers.clear()
        ours = _adam_run(shape, dtype, kwargs, alpha, transpose)
        assert bool(chainers) == (kwargs.get("amsgrad", False) or transpose)
        with chainer.using_config("cpu_kernels", "chainer"):
            switched_off = _adam_run(shape, dtype, kwargs, alpha, transpose)
    finally:
        monkeypatch.setattr(optimizers, "ORIGINAL", original)
        (stock.install if was else stock.uninstall)()
    assert ours == theirs == switched_off
