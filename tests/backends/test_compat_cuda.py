"""Chainer 7.8.1's CUDA path against the installed CuPy, checked without a GPU.

CI installs ``cupy-cuda13x`` (it imports without a GPU or CUDA libraries) so that these run there:
every CuPy name Chainer's code uses on our training path must exist in today's CuPy, and compat
must say in one line why CUDA is unusable instead of Chainer silently training on the CPU.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from pipeline.backends.chainer import compat

# Chainer modules our models, optimizers, tasks and serializers run through on a CUDA device.
ON_OUR_PATH = [
    "backends/cuda.py", "backend.py", "_backend.py", "backends/_cpu.py", "link.py", "variable.py",
    "function_node.py", "optimizer.py", "initializer.py", "initializers/normal.py",
    "functions/connection/convolution_2d.py", "functions/connection/linear.py",
    "functions/pooling/pooling_nd.py", "functions/pooling/max_pooling_nd.py",
    "functions/pooling/max_pooling_nd_kernel.py", "functions/pooling/pooling_nd_kernel.py",
    "functions/pooling/average_pooling_nd.py", "functions/pooling/average_pooling_2d.py",
    "functions/pooling/spatial_pyramid_pooling_2d.py",
    "functions/normalization/batch_normalization.py", "functions/noise/dropout.py",
    "functions/loss/softmax_cross_entropy.py", "functions/activation/relu.py",
    "functions/activation/softmax.py", "functions/activation/log_softmax.py",
    "functions/math/sum.py", "functions/math/basic_math.py", "functions/math/average.py",
    "functions/array/reshape.py", "functions/array/concat.py", "functions/array/broadcast.py",
    "optimizers/adam.py", "optimizers/momentum_sgd.py", "optimizers/sgd.py",
    "optimizer_hooks/weight_decay.py", "utils/conv.py", "utils/conv_nd.py",
    "serializers/npz.py", "links/connection/convolution_2d.py", "links/connection/linear.py",
    "links/normalization/batch_normalization.py",
]
# Looked up by Chainer inside try/except, absent on purpose: cuDNN (not shipped by CuPy 13+) and
# cupy.util, the CuPy < 8 fallback for cupy._util.
EXPECTED_MISSING = {"cupy.cudnn", "cupy.cuda.cudnn", "cupy.util.PerformanceWarning"}


def _chains(path: pathlib.Path) -> set[str]:
    """Dotted CuPy names used in a Chainer source file: ``cupy.x.y``, ``cuda.cupy.x`` and imports."""
    tree = ast.parse(path.read_text())
    found = set()
    shadow_cuda = path.name == "cuda.py"  # backends/cuda.py: `from cupy import cuda`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("cupy", "cupyx"):
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in ("cupy", "cupyx"))
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts, n = [], node
            while isinstance(n, ast.Attribute):
                parts.append(n.attr)
                n = n.value
            if not isinstance(n, ast.Name):
                continue
            parts = [n.id, *reversed(parts)]
            if parts[0] == "cuda" and len(parts) > 2 and parts[1] in ("cupy", "cupyx"):
                parts = parts[1:]
            elif parts[0] == "cuda" and shadow_cuda and len(parts) > 1 and parts[1][0].isupper():
                parts = ["cupy", *parts]
            if parts[0] in ("cupy", "cupyx") and len(parts) > 1:
                found.add(".".join(parts))
    return found


def _resolves(name: str) -> bool:
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            module = ".".join(parts[:i + 1])
            try:
                obj = importlib.import_module(module)
            except ImportError as exc:  # present, but needs a CUDA library this machine lacks
                return "Failure finding" in str(exc) and importlib.util.find_spec(module) is not None
        except ImportError as exc:  # a CUDA library CuPy loads lazily (cuBLAS...) is absent here
            return "Failure finding" in str(exc) and (
                importlib.util.find_spec(f"cupy_backends.cuda.libs.{part}") is not None
                or importlib.util.find_spec(".".join(parts[:i + 1])) is not None)
        if isinstance(obj, str):  # cupy.__version__.split and the like
            return True
    return True


def test_every_cupy_name_chainer_uses_on_our_path_exists():
    pytest.importorskip("cupy")
    root = pathlib.Path(compat.chainer.__file__).parent
    names = set()
    for rel in ON_OUR_PATH:
        names |= _chains(root / rel)
    assert len(names) > 30  # the scan itself works (42 names in Chainer 7.8.1)
    missing = sorted(n for n in names if n not in EXPECTED_MISSING and not _resolves(n))
    assert missing == [], f"CuPy lacks names Chainer uses: {missing}"


def test_chainer_cuda_backend_imports_through_compat_with_cupy_installed():
    pytest.importorskip("cupy")
    from chainer.backends import cuda
    reason = compat.cuda_status()
    if cuda.available:
        assert reason is None
    else:  # e.g. the plain wheel on a machine without the CUDA libraries
        assert reason and "\n" not in reason and len(reason) < 500
        if "libcublas" in reason:
            assert "cupy-cuda13x[ctk]" in reason


def test_cuda_status_names_the_missing_package(monkeypatch):
    from chainer.backends import cuda
    monkeypatch.setattr(cuda, "available", False)
    monkeypatch.setattr(cuda, "_resolution_error", ModuleNotFoundError("No module", name="cupy"),
                        raising=False)
    monkeypatch.setattr(compat, "installed_cupy_packages", lambda: [])
    assert compat.cuda_status().startswith("CuPy is not installed")
    monkeypatch.setattr(cuda, "_resolution_error", ImportError(
        'Failure finding "libcublasLt.so.13": No such file\n'), raising=False)
    line = compat.cuda_status()
    assert "\n" not in line and "libcublasLt" in line and "[ctk]" in line


def test_two_cupy_packages_are_reported(monkeypatch):
    monkeypatch.setattr(compat, "installed_cupy_packages", lambda: ["cupy-cuda12x", "cupy-cuda13x"])
    line = compat.cuda_status()
    assert "2 CuPy packages" in line and "cupy-cuda12x, cupy-cuda13x" in line


def test_pkg_resources_stand_in_honours_version_specifiers():
    """Where setuptools has no pkg_resources, the stand-in Chainer keeps must not say yes to all."""
    code = (
        "import sys; sys.modules['pkg_resources'] = None\n"  # import pkg_resources -> ImportError
        "from pipeline.backends.chainer import compat\n"
        "import chainer._environment_check as check\n"
        "compat.gradient_check  # imported on first use, under the same stand-ins\n"
        "import chainer.testing.helper as h\n"
        "pr = h.pkg_resources\n"
        "assert pr is check.pkg_resources, (pr, check.pkg_resources)\n"
        "assert pr.__name__ == 'pkg_resources' and not hasattr(pr, '__file__'), pr\n"
        "pr.require('numpy>=1')\n"
        "for bad, error in (('numpy<1', pr.VersionConflict), ('no-such-dist-xyz', pr.DistributionNotFound)):\n"
        "    try:\n"
        "        pr.require(bad)\n"
        "    except error:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('require(%r) passed' % bad)\n"
        "    assert issubclass(error, pr.ResolutionError)\n"
        "assert sys.modules.get('pkg_resources') is None\n"  # gone from sys.modules again
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_batch_norm_two_stage_sums_match_chainers():
    """The CuPy-only two-stage reduction, run with NumPy arrays through a stand-in array module."""
    from chainer.functions.normalization.batch_normalization import GeneralBatchNormalizationImpl
    impl = GeneralBatchNormalizationImpl()
    x = np.random.default_rng(0).standard_normal((8, 5, 6, 7)).astype(np.float32) * 3 + 1
    gy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    gamma = np.ones(5, np.float32)
    fake_xp = types.SimpleNamespace(square=np.square)  # "not numpy": takes the two-stage path
    mean, var = impl.get_mean_and_var((0, 2, 3), gamma, x, fake_xp, np.dtype(np.float32))
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, x.var(axis=(0, 2, 3)), rtol=1e-5)
    gbeta, ggamma = impl.get_ggamma_and_gbeta((0, 2, 3), gamma, gy, x, fake_xp)
    np.testing.assert_allclose(gbeta, gy.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ggamma, (gy * x).sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)
    # NumPy itself keeps Chainer's own code: CPU results are bit-for-bit what they were
    m2, v2 = impl.get_mean_and_var((0, 2, 3), gamma, x, np, np.dtype(np.float32))
    assert m2.tobytes() == x.mean(axis=(0, 2, 3), dtype=np.float32).tobytes()
