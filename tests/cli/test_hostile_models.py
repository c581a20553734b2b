"""A user's model that fails where the dry forward did not look: in training mode, at a real
batch size, in an optimizer update, by ``sys.exit``, on a worker in a later round, or by ending
its worker. Each is one line and exit 2 naming the model (and on a worker the stage and round),
through the CLI in a subprocess: the exit status is what is tested."""
from __future__ import annotations

import os
import textwrap

import pytest

from tests.helpers import REPO, TRAIN_INFO, assert_one_error_line, run_cli

HOSTILE = textwrap.dedent('''
    import os
    import sys

    import chainer
    import chainer.functions as F
    import chainer.links as L


    class Net(chainer.Chain):
        def __init__(self, n_classes=10):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, 4, 3, pad=1)
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            return self.fc(F.max_pooling_2d(F.relu(self.conv(x)), 4))


    class TrainOnly(Net):
        def forward(self, x):
            if chainer.config.train:
                raise RuntimeError("no training mode here")
            return super().forward(x)


    class FixedBatch(Net):
        def forward(self, x):  # a batch of 2 whatever came in: the dry forward's size
            return F.reshape(super().forward(x), (2, -1))


    def exits():
        sys.exit(3)


    class ExitsInForward(Net):
        def forward(self, x):
            sys.exit("bye")


    def _on_worker():
        try:
            from distributed import get_worker
            get_worker()
            return True
        except Exception:
            return False


    class Round2(Net):
        """Raises in its third training forward on a worker (round 2 at one step a round),
        counting in the file HOSTILE_COUNT names; the driver's check never sees it."""

        def forward(self, x):
            if chainer.config.train and _on_worker():
                path = os.environ["HOSTILE_COUNT"]
                n = int(open(path).read() or 0) if os.path.exists(path) else 0
                open(path, "w").write(str(n + 1))
                if n >= 2:
                    raise ValueError("broke at step 3")
            return super().forward(x)


    class Kills(Net):
        def forward(self, x):
            if chainer.config.train and _on_worker():
                os._exit(1)
            return super().forward(x)
''')

TRAIN = ("train", "--data", "synthetic:64:16", "--epochs", "1", "--batch-size", "8",
         "--no-progress")
ON_A_WORKER = ("--workers", "1", "--replicas", "1", "--strategy", "single", "--mix-every", "1")


@pytest.fixture
def code(tmp_path):
    """The user's modules, outside the repository; the CLI runs there."""
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    return tmp_path


def _train(code, *args, env=None):
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(code)])
    return run_cli(*TRAIN, "--out", str(code / "run"), *args, cwd=code, env=environ,
                   timeout=180)


def _refused(proc, *needles, before=()):
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = assert_one_error_line(proc.stderr, before)
    for needle in needles:
        assert needle in line, line
    return line


@pytest.mark.parametrize("args, needles", [
    (("--model", "hostile:TrainOnly"),
     ["hostile:TrainOnly failed in its forward in training mode on a (8, 3, 32, 32)",
      "RuntimeError: no training mode here"]),
    (("--model", "hostile:FixedBatch"),
     ["hostile:FixedBatch maps (8, 3, 32, 32) in training mode to shape (2, 40), not (8, 10)"]),
    (("--model", "hostile:Net", "--optimizer", "momentum", "--optimizer-args",
      '{"momentum": "0.9"}'),
     ['train.optimizer_args {"momentum": "0.9"} do not fit momentum', "TypeError"]),
    (("--optimizer", "momentum", "--optimizer-args", '{"momentum": "0.9"}'),
     ["do not fit momentum: one update of a small Linear raised"]),
    (("--model", "hostile:exits"), ["model hostile:exits() raised SystemExit: 3"]),
    (("--model", "hostile:ExitsInForward"),
     ["hostile:ExitsInForward failed on a (2, 3, 32, 32) float32 batch: SystemExit: bye"]),
    (("--model", "exits_at_import:Net"),
     ["--model exits_at_import:Net: cannot import exits_at_import (SystemExit: 0)"]),
    (("--model-args", '{"width": 3}'),
     ["--model-args {\"width\": 3}: model small-cnn is built in and takes no arguments"]),
    (("--model", "resnet50", "--model-args", '{"n_classes": 3}'),
     ["model resnet50 is built in and takes no arguments"]),
])
def test_refused_before_a_cluster_starts(code, args, needles):
    proc = _train(code, *args)
    _refused(proc, *needles)
    assert "started local cluster" not in proc.stderr
    assert not (code / "run").exists()


def test_an_error_in_round_2_on_a_worker_names_model_stage_and_round(code):
    proc = _train(code, "--model", "hostile:Round2", *ON_A_WORKER,
                  env={"HOSTILE_COUNT": str(code / "count")})
    _refused(proc, "model hostile:Round2 failed in its forward in round 2 (replica 0) on a "
                   "worker: ValueError: broke at step 3", before=None)
    assert "Traceback" not in proc.stderr and "Compute Failed" not in proc.stderr


@pytest.mark.slow
def test_a_model_that_kills_its_worker_is_named_after_one_replay(code):
    proc = _train(code, "--model", "hostile:Kills", *ON_A_WORKER)
    line = _refused(proc, "worker died inside model hostile:Kills's train task, round 0, and "
                          "again when it was replayed", before=None)
    assert "Cancelled" not in line and "forgotten" not in line, line
    assert proc.stderr.count("replaying") == 1, proc.stderr  # one replay, not four
