"""Checkpoints: atomic, checksummed, and a damaged latest falls back to the one before."""
import numpy as np
import pytest

from pipeline.outputs import checkpoint
from pipeline.core.state import HostState
from pipeline.core.errors import ResumeError
from tests.helpers import host_state


def _state(r):
    return host_state(r, replicas=2, opts=True, outer=True)



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


def test_has_checkpoint_counts_only_round_directories_of_ours(tmp_path):
    from pipeline.outputs import fs
    from pipeline.outputs.run_dir import RunDir
    (tmp_path / "checkpoints").mkdir()
    assert not fs.has_checkpoint(tmp_path)
    assert not RunDir(tmp_path, None).has_checkpoint()  # an empty checkpoints/ holds none
    elsewhere = checkpoint.save(tmp_path / "other", _state(1), {}, {})
    (tmp_path / "checkpoints" / elsewhere.name).symlink_to(elsewhere)
    assert not fs.has_checkpoint(tmp_path)  # a link is never read or pruned, so never counted
    checkpoint.save(tmp_path, _state(2), {}, {})
    assert fs.has_checkpoint(tmp_path) and RunDir(tmp_path, None).has_checkpoint()


def test_settle_puts_the_old_run_back_when_the_new_one_has_only_a_linked_checkpoint(tmp_path):
    from pipeline.outputs import fs
    (tmp_path / "model.npz").write_text("old")
    fs.set_aside(tmp_path, ("model.npz", "checkpoints"))
    (tmp_path / "checkpoints").mkdir()
    elsewhere = checkpoint.save(tmp_path / "other", _state(1), {}, {})
    (tmp_path / "checkpoints" / elsewhere.name).symlink_to(elsewhere)
    fs.settle(tmp_path)
    assert (tmp_path / "model.npz").read_text() == "old"


def test_a_checkpoint_records_its_epochs_but_a_resume_may_change_them():
    from pipeline.core.config import Config
    from pipeline.outputs import resume
    config = Config()
    saved = resume.recorded(config)
    assert "cluster" not in saved and saved["train"]["epochs"] == config.train.epochs
    assert "epochs" not in resume.must_match(saved)["train"]
    longer = config.to_dict()
    longer["train"] = {**longer["train"], "epochs": config.train.epochs + 1}
    resume.check_same_run(saved, longer, "run")
