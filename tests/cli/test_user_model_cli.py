"""`--model pkg.module:factory` through the CLI: a module outside the repository trains,
evaluates and resumes; each broken model is one line and exit 2 before any cluster starts; a
run directory's config.json never makes us import code."""
from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest

from tests.helpers import REPO, run_cli

NETS = textwrap.dedent('''
    import chainer
    import chainer.functions as F
    import chainer.links as L


    class Net(chainer.Chain):
        def __init__(self, n_classes=10, width=4):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, width, 3, pad=1)
                self.bn = L.BatchNormalization(width)
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            h = F.dropout(F.max_pooling_2d(F.relu(self.bn(self.conv(x))), 4), 0.3)
            return self.fc(h)


    def three_classes():
        return Net(n_classes=3)


    def not_a_link():
        return 42


    def raises(n_classes=10):
        raise RuntimeError("no GPU here")


    def bad_forward():
        net = Net()
        net.forward = lambda x: F.reshape(x, (len(x), 7, -1))  # 3072 is no multiple of 7
        return net
''')
EVIL = 'open(__file__ + ".imported", "w").close()\n\ndef system(*a):\n    pass\n'

TRAIN = ("train", "--data", "synthetic:120:40", "--epochs", "1", "--batch-size", "20",
         "--strategy", "ipm", "--replicas", "2", "--mix-every", "3", "--workers", "2",
         "--no-progress")


@pytest.fixture
def code(tmp_path):
    """A directory outside the repository with the user's modules; the CLI runs there."""
    (tmp_path / "nets.py").write_text(NETS)
    (tmp_path / "evil.py").write_text(EVIL)
    return tmp_path


def _env(code):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(code)])
    return env


def _one_line_exit_2(proc, *needles):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


@pytest.mark.parametrize("model, needles", [
    ("nosuchmodule:Net", ["cannot import nosuchmodule"]),
    ("nets:Missing", ["nets has no Missing"]),
    ("nets:not_a_link", ["returned int, not a chainer.Link"]),
    ("nets:raises", ["raised RuntimeError: no GPU here"]),
    ("nets:three_classes", ["maps (2, 3, 32, 32) to shape (2, 3), not (2, 10)"]),
    ("nets:bad_forward", ["failed on a (2, 3, 32, 32) float32 batch"]),
    ("vgg16", ["vgg16 fixes its input at 224x224", "32x32"]),
    ("googlenet", ["googlenet fixes its input at 224x224"]),
    ("os.path", ["model.name must be one of", "pkg.module:factory"]),
])
def test_each_broken_model_is_one_line_exit_2(code, tmp_path, model, needles):
    proc = run_cli(*TRAIN, "--model", model, "--out", str(tmp_path / "run"), cwd=code,
                   env=_env(code))
    _one_line_exit_2(proc, *needles)
    assert not (tmp_path / "run").exists()


def test_bad_model_args_are_one_line(code, tmp_path):
    out = ("--out", str(tmp_path / "run"))
    proc = run_cli(*TRAIN, *out, "--model", "nets:Net", "--model-args", "[1]", cwd=code,
                   env=_env(code))
    _one_line_exit_2(proc, "model.args must be a JSON object")
    proc = run_cli(*TRAIN, *out, "--model", "nets:Net", "--model-args", '{"depth": 3}', cwd=code,
                   env=_env(code))
    _one_line_exit_2(proc, "nets:Net", "depth")


def test_trains_evaluates_and_resumes_only_when_named_again(code, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(*TRAIN, "--model", "nets:Net", "--model-args", '{"width": 3}', "--out",
                   str(out), cwd=code, env=_env(code), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["name"] == "nets:Net" and saved["model"]["args"] == '{"width": 3}'
    assert saved["model"]["input_size"] == 32

    _one_line_exit_2(run_cli("evaluate", "--run", str(out), cwd=code, env=_env(code)),
                     "this run's model is your own code", "--model pkg.module:factory")
    _one_line_exit_2(run_cli("train", "--resume", str(out), "--epochs", "2", cwd=code,
                             env=_env(code)), "this run's model is your own code")
    proc = run_cli("evaluate", "--run", str(out), "--model", "nets:Net", cwd=code,
                   env=_env(code), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["n"] == 40
    proc = run_cli("train", "--resume", str(out), "--epochs", "2", "--model", "nets:Net",
                   "--no-progress", cwd=code, env=_env(code), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["os:system", "evil:system", "subprocess:run"])
def test_a_crafted_config_imports_nothing(code, tmp_path, name):
    """A run directory whose config.json names code: resume and evaluate say which model the
    run needs without echoing the recorded path, exit 2, and import nothing (evil.py would
    leave a mark)."""
    out = tmp_path / "run"
    proc = run_cli(*TRAIN, "--model", "small-cnn", "--out", str(out), cwd=code, env=_env(code),
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    config["model"]["name"] = name
    (out / "config.json").write_text(json.dumps(config))
    for args in (("train", "--resume", str(out), "--epochs", "2"), ("evaluate", "--run", str(out))):
        line = _one_line_exit_2(run_cli(*args, cwd=code, env=_env(code)),
                                "this run's model is your own code")
        assert name not in line
    assert not (code / "evil.py.imported").exists()
    shutil.rmtree(out)
