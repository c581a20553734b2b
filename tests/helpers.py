"""What many tests share: state-dict assertions, a config from a base plus changes, a host
state, the CLI in a subprocess and its one error line, a run's saved weights, a directory's
bytes, waiting for a run's lines. Named ``assert_*`` where they assert, so a failure points at
the caller's line (dask's ``assert_eq``, distributed's ``utils_test``)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def assert_same_bits(a: dict, b: dict, context=None) -> None:
    """Same keys, dtypes, shapes and bytes in two state dicts; ``context`` (a log, the kills)
    goes into the message."""
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)), context)
    for k in a:
        assert _same(a[k], b[k]), (k, context)


def same_bits(a: dict, b: dict) -> bool:
    """:func:`assert_same_bits` as a question (``not same_bits(...)``, ``all(...)``)."""
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _same(x, y) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Same keys, every array equal to float tolerance."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def make_config(base: Mapping, **changes):
    """``Config().replace(**base, **changes)``: a test module's base settings plus a test's."""
    from pipeline import Config
    return Config().replace(**{**base, **changes})


def make_states(k: int, seed: int, dtype=np.float32, spread: int = 0) -> list[dict]:
    """K replica states like a small Chainer model: conv W and b, a BatchNorm statistic and its
    int N (``100 + i`` in replica i), a small fc W. With ``spread`` the conv weights span
    10**-spread..10**spread, so float64 sums of them are not exact and only the same order of
    additions gives the same bits."""
    rng = np.random.default_rng(seed)
    states = []
    for i in range(k):
        conv = rng.standard_normal((4, 3, 3, 3))
        if spread:
            conv = conv * 10.0 ** rng.integers(-spread, spread, conv.shape)
        states.append({"/conv1/W": conv.astype(dtype),
                       "/conv1/b": rng.standard_normal(4).astype(dtype),
                       "/bn1/avg_mean": rng.standard_normal(4).astype(dtype),
                       "/bn1/N": np.array(100 + i, np.int64),
                       "/fc/W": (rng.standard_normal((10, 4)) * 1e-3).astype(dtype)})
    return states


def host_state(round_: int, replicas: int = 1, opts: bool = False, outer: bool = False):
    """A small ``HostState`` whose values say its round: ``conv1/W`` full of ``round_``."""
    from pipeline.core.state import HostState
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


def saved_weights(out: str | Path) -> dict:
    """``OUT/model.npz`` of a run as a state dict (the arrays as written)."""
    with np.load(Path(out) / "model.npz") as z:
        return {k: z[k] for k in z.files}


def loaded_weights(out: str | Path, model: str = "small-cnn") -> dict:
    """``OUT/model.npz`` loaded the way a user loads it (Chainer's ``load_npz`` into a fresh
    ``model``), as a state dict."""
    from pipeline.backends.chainer.compat import serializers
    from pipeline.backends.chainer.models import build_model
    from pipeline.backends.chainer.state import get_state
    link = build_model(model)
    serializers.load_npz(str(Path(out) / "model.npz"), link)
    return get_state(link)


def tree_bytes(path: str | Path) -> dict:
    """``{relative path: bytes}`` of everything under ``path`` (directories as None; ``{}``
    when it does not exist): compare before and after to see that nothing changed."""
    path = Path(path)
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(path.rglob("*"))}


def assert_one_error_line(stderr: str, before: tuple[str, ...] | None = ()) -> str:
    """The ``error:`` line of a command's stderr, which must be its last line, with no
    traceback. ``before``: the prefixes a line before it may start with (the connection
    summary, a skipped checkpoint); ``()``, none may come before; None, any may."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr
    if before is not None:
        assert all(x.startswith(before) for x in lines[:-1]) if before else len(lines) == 1, \
            stderr
    return lines[-1]


# Lines `train` may print before its error line: the connection summary of `connect` (bad data,
# a missing resource or a too large batch are found once connected), and one warning per damaged
# checkpoint that a resume skipped.
TRAIN_INFO = ("connected to ", "started local cluster ", "skipping checkpoint ")


def assert_train_refused(capsys, *args: str, out: Path | None = None) -> str:
    """Run ``train ARGS [--out OUT]`` in process; assert exit 2, nothing on stdout, one error
    line (after ``TRAIN_INFO`` lines only), and no outputs: OUT absent, or (found only after
    connecting) empty, or as it was. Returns the error line."""
    from pipeline.cli.parser import main
    before = tree_bytes(out) if out is not None else {}
    existed = out is not None and out.exists()
    code = main(["train", *args] + (["--out", str(out)] if out is not None else []))
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == "", (code, stdout, stderr)
    line = assert_one_error_line(stderr, TRAIN_INFO)
    if out is not None:
        if existed:
            assert tree_bytes(out) == before, "the output directory changed"
        else:
            assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    return line


def no_cluster(*args, **kwargs):
    """Stands in for ``pipeline.cluster.connection.connect`` where none may start."""
    raise AssertionError("a cluster was started")


def plain_unpickle(path: str | Path):
    """A CIFAR python batch read with plain pickle (trusted: the tests' own files)."""
    import pickle
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def wait_for_lines(path: str | Path, n: int, proc: subprocess.Popen,
                   timeout: float = 60.0) -> None:
    """Return once ``path`` has ``n`` lines (a run's metrics.jsonl); fail if ``proc`` ends
    first, and kill it (its process group when it leads one) after ``timeout`` seconds."""
    import signal
    import time
    path, deadline = Path(path), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}):\n"
                                 f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    try:
        if os.getpgid(proc.pid) == proc.pid:  # started with start_new_session: its workers too
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    raise AssertionError(f"{path} did not reach {n} lines in {timeout:g} s")


def readme_train_example() -> tuple[list[str], float]:
    """The README's `train` example (its arguments) and the test accuracy the README states."""
    import re
    import shlex
    text = (REPO / "README.md").read_text()
    command = re.search(r"^python -m pipeline train (--data .*?)$(?<!\\)", text,
                        re.M | re.S).group(1)
    args = shlex.split(command.replace("\\\n", " "))
    stated = float(re.search(r"The `train` example reaches a test accuracy of ([0-9.]+)",
                             text).group(1))
    return args, stated


@contextlib.contextmanager
def user_code(root: Path, name: str, source: str):
    """Module ``name`` written from ``source`` into ``root`` (a directory outside the
    repository, as a user's code is), put on sys.path and imported; taken away afterwards."""
    import importlib
    (root / f"{name}.py").write_text(source)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(name, None)
