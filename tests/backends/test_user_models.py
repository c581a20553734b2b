"""The user-model seam on its own: Chainer's architectures by name with a fresh head and no
download, a factory shipped by value to a process that cannot import its module, the seeded
global RNGs, the recorded import path."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pipeline.backends import ModelRef, get_backend
from pipeline.backends.chainer import user_models
from tests.helpers import REPO, assert_same_bits


def test_resnet50_by_name_random_init_fresh_head_no_download(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAINER_DATASET_ROOT", str(tmp_path))
    backend = get_backend()
    ref = backend.resolve_model("resnet50", "{}", None, (32, 32), 7)
    assert isinstance(ref, ModelRef) and ref.path == "resnet50"
    params = backend.init_params(ref, 7, seed=1)
    assert params["net/fc6/W"].shape == (7, 2048)
    assert float(np.abs(params["net/conv1/W"]).sum()) > 0  # random, not the zeros of 'auto'
    again = backend.init_params(ref, 7, seed=1)
    assert_same_bits(params, again)
    assert list(tmp_path.iterdir()) == []  # nothing fetched


def test_vgg16_at_its_own_size_passes_the_contract_and_elsewhere_is_one_line():
    from pipeline.core.errors import UsageError
    with pytest.raises(UsageError, match="fixes its input at 224x224"):
        get_backend().resolve_model("vgg16", "{}", None, (64, 64), 10)


def test_a_factory_travels_by_value_to_a_process_without_its_module(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "farnets.py").write_text(textwrap.dedent('''
        import chainer
        import chainer.links as L

        class Far(chainer.Chain):
            def __init__(self, n_classes=10):
                super().__init__()
                with self.init_scope():
                    self.fc = L.Linear(None, n_classes)

            def forward(self, x):
                return self.fc(x)
    '''))
    sys.path.insert(0, str(code))
    try:
        ref = get_backend().resolve_model("farnets:Far", "{}", "farnets:Far", (16, 16), 4)
        blob = pickle.dumps(ref)
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("farnets", None)
    (tmp_path / "ref.pkl").write_bytes(blob)
    check = ("import pickle, sys; ref = pickle.load(open(sys.argv[1], 'rb')); "
             "from pipeline.backends import get_backend; "
             "p = get_backend().init_params(ref, 4, 0); "
             "print(sorted((k, v.shape) for k, v in p.items()))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "ref.pkl")],
                          capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "('fc/W', (4, 768))" in proc.stdout  # the lazy Linear sized at 3 x 16 x 16


def test_same_factory_same_token():
    a = user_models.make_ref("resnet50", "{}", None, (32, 32))
    b = user_models.make_ref("resnet50", "{}", None, (32, 32))
    c = user_models.make_ref("resnet50", "{}", None, (64, 64))
    assert a.token == b.token != c.token


def test_seeded_globals_are_keyed_and_restored():
    import random
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    with user_models.seeded_globals(0, "dropout", 3, 1):
        a = np.random.rand(4), random.random()
    with user_models.seeded_globals(0, "dropout", 3, 1):
        b = np.random.rand(4), random.random()
    with user_models.seeded_globals(0, "dropout", 3, 2):
        c = np.random.rand(4), random.random()
    assert a[0].tobytes() == b[0].tobytes() and a[1] == b[1]
    assert a[0].tobytes() != c[0].tobytes()
    assert (np.random.get_state()[1] == before).all()


def test_a_recorded_path_is_module_and_qualname():
    from pipeline.backends.user import path_of
    assert path_of(user_models.ZooNet) == "pipeline.backends.chainer.user_models:ZooNet"


def _sleeps(n_classes=10):
    import time
    time.sleep(60)


def test_a_factory_that_sleeps_past_the_limit_is_one_line(monkeypatch):
    """The factory and the contract's steps run under ``CHECK_SECONDS`` on the driver."""
    import time

    from pipeline.core.errors import UsageError
    monkeypatch.setattr(user_models, "CHECK_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"model .*:_sleeps did not build and take one step "
                                         r"within 0.5 s"):
        get_backend().resolve_model("x", "{}", _sleeps, (8, 8), 3)
    assert time.monotonic() - start < 10


def _broken_backward(n_classes=10):
    from pipeline.backends.chainer.compat import L, chainer

    class NoGradient(chainer.FunctionNode):
        def forward(self, inputs):
            return inputs

        def backward(self, indexes, grads):
            raise RuntimeError("no gradient here")

    class Net(chainer.Chain):
        def __init__(self, n_classes=10):
            super().__init__()
            with self.init_scope():
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            return NoGradient().apply((self.fc(x),))[0]

    return Net(n_classes)


def test_a_backward_that_raises_is_named_by_the_contract_and_in_a_task():
    """With the run's train section the contract takes one step (its backward fails there);
    without it, a task's step says the model, the stage and the round."""
    from pipeline.core.config import Config
    from pipeline.core.errors import UsageError
    from pipeline.core.rng import rng_for
    from pipeline.training.tasks import StepSpec
    backend = get_backend()
    with pytest.raises(UsageError, match=r"_broken_backward failed in its backward on a "
                                         r"\(4, 3, 8, 8\) float32 batch: RuntimeError: no "
                                         r"gradient here"):
        backend.resolve_model("x", "{}", _broken_backward, (8, 8), 3,
                              train=Config().replace(**{"train.batch_size": 4}).train)
    ref = backend.resolve_model("x", "{}", _broken_backward, (8, 8), 3)
    params = backend.init_params(ref, 3, seed=0)
    spec = StepSpec(ref, 3, "sgd", 0.0, 0.0, (0.1,), 4, "steps", 0, 5, 1)
    images = np.zeros((4, 3, 8, 8), np.uint8)
    with pytest.raises(UsageError, match=r"_broken_backward failed in its backward in round 5 "
                                         r"\(replica 1\) on a worker: RuntimeError: no gradient"):
        backend.train_steps(params, None, images, np.zeros(4, np.int32), spec,
                            rng_for(0, "dropout", 5, 1))


def test_the_time_limit_gives_an_outer_timer_back(monkeypatch):
    """pytest-timeout (or a caller) arms SIGALRM too: its deadline and handler survive."""
    import signal
    import time

    from pipeline.core.errors import UsageError
    calls = []
    previous = signal.signal(signal.SIGALRM, lambda *a: calls.append(time.monotonic()))
    outer = signal.getitimer(signal.ITIMER_REAL)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        start = time.monotonic()
        with pytest.raises(UsageError, match="within 0.3 s"):
            with user_models.timed("p", 0.3):
                time.sleep(5)
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.3
        while not calls and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert calls and 1.3 < calls[0] - start < 2.5
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *outer)
