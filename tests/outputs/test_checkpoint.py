"""Checkpoints: atomic, checksummed, and a damaged latest falls back to the one before."""
import numpy as np
import pytest

from pipeline.outputs import checkpoint
from pipeline.outputs.checkpoint import HostState
from pipeline.core.errors import ResumeError


def _state(r):
    p = {"conv1/W": np.full((2, 2), r, np.float32), "bn/N": np.array(r)}
    return HostState(r, [p, p], [{"t": np.array(r)}, None], {"conv1/W": np.zeros((2, 2))})


def test_save_load_round_trip(tmp_path):
    checkpoint.save(tmp_path, _state(3), {"conv1/W": np.ones(1)}, {"seed": 0})
    state, meta = checkpoint.load_latest(tmp_path)
    assert state.round == 3 and meta["config"] == {"seed": 0}
    assert np.array_equal(state.params[1]["conv1/W"], _state(3).params[1]["conv1/W"])
    assert state.opts[1] is None and state.opts[0]["t"] == 3
    assert state.outer is not None
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary leftovers


def test_keeps_the_last_two(tmp_path):
    for r in range(4):
        checkpoint.save(tmp_path, _state(r), {}, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "round-000002", "round-000003"]


def test_damaged_latest_falls_back(tmp_path):
    checkpoint.save(tmp_path, _state(1), {}, {})
    latest = checkpoint.save(tmp_path, _state(2), {}, {})
    data = (latest / "state.npz").read_bytes()
    (latest / "state.npz").write_bytes(data[: len(data) // 2])
    warnings = []
    state, _ = checkpoint.load_latest(tmp_path, warn=warnings.append)
    assert state.round == 1 and "round-000002" in warnings[0]
    with pytest.raises(ResumeError, match="SHA-256"):
        checkpoint.verify(latest)


def test_write_atomic_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    checkpoint.write_atomic(target, "old")

    with pytest.raises(TypeError):
        checkpoint.write_atomic(target, 123)  # neither str nor bytes
    assert target.read_text() == "old" and len(list(tmp_path.iterdir())) == 1
