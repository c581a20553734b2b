"""A plain ``import chainer`` in the user's own module works in any order: the line of
``_dask_chainer_pipeline_hook.pth`` (run at interpreter start where the package is installed)
puts the hook first, and Chainer imports under ``shims``; both wheels install that line."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO

PTH = REPO / "_dask_chainer_pipeline_hook.pth"

# A user's script: Chainer first, a few SGD steps of a Link, then ours.
_CHAINER_FIRST = """
import sys
import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
link = L.Linear(3, 2)
opt = chainer.optimizers.SGD(lr=0.01)
opt.setup(link)
x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
losses = []
for _ in range(5):
    link.cleargrads()
    loss = F.mean_squared_error(link(x), np.zeros((8, 2), np.float32))
    loss.backward()
    opt.update()
    losses.append(float(loss.array))
assert losses[-1] < losses[0], losses
assert "pkg_resources" not in sys.modules or hasattr(sys.modules["pkg_resources"], "__file__")
import pipeline
from pipeline.backends.chainer.compat import chainer as ours
assert ours is chainer
print("ok")
"""

_PIPELINE_FIRST = """
import pipeline
from pipeline.backends.chainer.compat import L
import chainer
assert chainer.links.Linear is L.Linear and L.Linear(2, 2)(chainer.Variable(
    __import__("numpy").ones((1, 2), "float32"))).shape == (1, 2)
print("ok")
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter after the .pth's own line, outside the repository."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    line = PTH.read_text().strip()
    return subprocess.run([sys.executable, "-c", f"{line}\n{code}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("code", [_CHAINER_FIRST, _PIPELINE_FIRST], ids=["chainer-first",
                                                                        "pipeline-first"])
def test_import_chainer_in_either_order(code, tmp_path):
    out = _run(code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_hook_imports_nothing_at_start_and_leaves_after_chainer(tmp_path):
    code = ("import sys, _dask_chainer_pipeline_hook as h\n"
            "heavy = [m for m in ('numpy', 'dask', 'pipeline', 'chainer') if m in sys.modules]\n"
            "assert heavy == [] and h.ChainerFinder in sys.meta_path, heavy\n"
            "import chainer\n"
            "assert h.ChainerFinder not in sys.meta_path\n"
            "print('ok')\n")
    out = _run(code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.slow
def test_both_wheels_install_the_hook(tmp_path):
    """``pip install .`` and ``pip install -e .`` (setup.py's commands): the .pth at the root of
    site-packages, and the module beside it in the regular wheel."""
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                   check=True, env=env, capture_output=True, timeout=300)
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_editable(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", build, str(tmp_path / "editable")], cwd=REPO,
                   check=True, env=env, capture_output=True, timeout=300)
    wheels = sorted(tmp_path.rglob("*.whl"))
    assert len(wheels) == 2, wheels
    for wheel in wheels:
        names = zipfile.ZipFile(wheel).namelist()
        assert PTH.name in names, (wheel.name, names)
        if ".editable" not in wheel.name:
            assert "_dask_chainer_pipeline_hook.py" in names
            assert zipfile.ZipFile(wheel).read(PTH.name).decode() == PTH.read_text()
