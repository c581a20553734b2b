"""What many tests share: state-dict assertions, a config from a base plus changes, a host
state, and the CLI in a subprocess. Named ``assert_*`` where they assert, so a failure points
at the caller's line (dask's ``assert_eq``, distributed's ``utils_test``)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def assert_same_bits(a: dict, b: dict, context=None) -> None:
    """Same keys, dtypes and bytes in two state dicts; ``context`` (a log, the kills) goes into
    the message."""
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)), context)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), (k, context)


def assert_close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Same keys, every array equal to float tolerance."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def make_config(base: Mapping, **changes):
    """``Config().replace(**base, **changes)``: a test module's base settings plus a test's."""
    from pipeline import Config
    return Config().replace(**{**base, **changes})


def host_state(round_: int, replicas: int = 1, opts: bool = False, outer: bool = False):
    """A small ``HostState`` whose values say its round: ``conv1/W`` full of ``round_``."""
    from pipeline.outputs.checkpoint import HostState
    params = {"conv1/W": np.full((2, 2), round_, np.float32)}
    if opts:
        params["bn/N"] = np.array(round_)
    opt = [{"t": np.array(round_)}] + [None] * (replicas - 1) if opts else [None] * replicas
    return HostState(round_, [params] * replicas, opt,
                     {"conv1/W": np.zeros((2, 2))} if outer else None)


def run_cli(*args: str, cwd: str | Path = REPO, env: Mapping | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` in a subprocess (this checkout first on the path, no GPU, no
    scheduler from the environment), bounded by ``timeout`` seconds."""
    base = dict(os.environ if env is None else env)
    base.setdefault("PYTHONPATH", str(REPO))
    base.setdefault("CUDA_VISIBLE_DEVICES", "")
    base.pop("DASK_SCHEDULER_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=str(cwd), env=base,
                          capture_output=True, text=True, timeout=timeout)
