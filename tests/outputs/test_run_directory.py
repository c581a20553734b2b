"""The output directory and what a run trusts when it reads one back.

Classes of the hardening issue: data loss in --out (3), a non-finite model reported as success
(4), tracebacks instead of one line (8: metrics lines, config types, a full disk), and what resume
trusts (9: the cluster section, meta.json, JSON outputs, CIFAR-100's class count, the demo's
network probe). docs/reliability.md lists every case and message.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.outputs import checkpoint
from pipeline.data import cifar
from pipeline.core import npz
from pipeline.outputs import run_dir as outputs
from pipeline.outputs import fs
from pipeline.core.state import HostState
from pipeline.cli.parser import build_parser, main
from pipeline.cli.commands import config_from_args
from pipeline.core.config import ClusterConfig
from pipeline.core.errors import ResumeError
from tests.helpers import assert_one_error_line, host_state, tree_bytes

GOOD = ["--data", "synthetic:64:16", "--model", "small-cnn", "--strategy", "ipm",
        "--replicas", "2", "--batch-size", "8", "--mix-every", "2", "--epochs", "0.5",
        "--no-progress"]
INFO_PREFIXES = ("output: ", "connected to ", "started local cluster ", "skipping checkpoint ",
                 "resuming ", "ipm: ", "average: ", "removed ", "the new run failed")
# The error line, after none but those lines (the output path, the cluster, the plan, a
# skipped checkpoint).
_one_error_line = functools.partial(assert_one_error_line, before=INFO_PREFIXES)


def _train(*args, scheduler) -> int:
    return main(["train", *GOOD, "--scheduler", scheduler, *args])


@pytest.fixture(scope="module")
def finished(tmp_path_factory, dask_client) -> Path:
    """A finished run of GOOD for one epoch (2 rounds, a checkpoint after each)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *GOOD, "--epochs", "1", "--checkpoint-every", "1", "--scheduler",
                 dask_client.scheduler.address, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run", symlinks=True))


# --- 3. nothing lost in --out -------------------------------------------------------------------


def _foreign(tmp_path: Path) -> Path:
    """Somebody else's directory that happens to hold our file names."""
    d = tmp_path / "theirs"
    (d / "checkpoints" / "round-000001").mkdir(parents=True)
    (d / "checkpoints" / "round-000001" / "notes.txt").write_text("keep me")
    (d / "config.json").write_text('{"mine": true}')
    (d / "model.npz").write_bytes(b"their model")
    (d / "metrics.jsonl").write_text("their metrics\n")
    return d


@pytest.mark.parametrize("extra", [[], ["--overwrite"]])
def test_a_directory_that_is_not_ours_is_never_touched(tmp_path, capsys, scheduler, extra):
    theirs = _foreign(tmp_path)
    before = tree_bytes(theirs)
    assert _train("--out", str(theirs), *extra, scheduler=scheduler) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{theirs} is not empty and holds no run of ours (no .dask-chainer-run marker)" in line
    assert tree_bytes(theirs) == before


def test_demo_refuses_a_directory_that_is_not_ours(tmp_path, capsys):
    theirs = _foreign(tmp_path)
    before = tree_bytes(theirs)
    assert main(["demo", "--out", str(theirs)]) == 2
    assert "holds no run of ours" in _one_error_line(capsys.readouterr().err)
    assert tree_bytes(theirs) == before


def test_an_empty_directory_is_claimed_and_marked(tmp_path, scheduler):
    (tmp_path / "empty").mkdir()
    assert _train("--out", str(tmp_path / "empty"), scheduler=scheduler) == 0
    assert fs.is_ours(tmp_path / "empty")
    assert (tmp_path / "empty" / "model.npz").exists()


def test_a_failed_overwrite_gives_the_old_run_back(run_copy, dask_client):
    from pipeline.training.loop import train

    class Stop(Exception):
        pass

    def stop(line):
        raise Stop  # after the first round, before the first checkpoint
    before = tree_bytes(run_copy)
    args = build_parser().parse_args(["train", *GOOD, "--out", str(run_copy), "--seed", "9",
                                      "--checkpoint-every", "0"])
    log = []
    with pytest.raises(Stop):
        train(config_from_args(args), dask_client, overwrite=True, on_round=stop, log=log.append)
    assert tree_bytes(run_copy) == before  # every byte of the old run is back, nothing new is left
    assert any("is back in" in x for x in log)


def test_an_overwrite_replaces_the_old_run_once_the_new_one_has_a_checkpoint(run_copy,
                                                                              scheduler):
    old_model = (run_copy / "model.npz").read_bytes()
    assert _train("--out", str(run_copy), "--overwrite", "--seed", "9",
                  scheduler=scheduler) == 0
    assert (run_copy / "model.npz").read_bytes() != old_model
    assert not (run_copy / fs.PREVIOUS).exists()
    assert [p.name for p in (run_copy / "checkpoints").iterdir()] == ["round-000000"]


def test_an_overwrite_killed_midway_is_settled_by_the_next_command(run_copy):
    before = tree_bytes(run_copy)
    names = outputs.RUN_FILES + outputs.RUN_DIRS
    fs.set_aside(run_copy, names)  # what --overwrite does first; then it is killed ...
    (run_copy / "config.json").write_text("{}")  # ... having written a little of the new run
    (run_copy / "metrics.jsonl").write_text('{"round": 0}\n')
    fs.settle(run_copy)
    assert tree_bytes(run_copy) == before
    fs.set_aside(run_copy, names)  # killed again, but after the new run's first checkpoint
    checkpoint.save(run_copy, HostState(0, [{"w": np.ones(2)}], [None], None), {}, {})
    fs.settle(run_copy)
    assert not (run_copy / fs.PREVIOUS).exists() and not (run_copy / "model.npz").exists()


def test_pruning_keeps_our_newest_and_touches_only_round_directories(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("round-9999999", "round-abc", "round-000007.bak", "round-00001"):
        (root / name).mkdir(parents=True)  # sort after ours as strings; none is ours
    (root / "round-000010").mkdir()  # a later checkpoint of a run this one replays
    for r in range(1, 4):
        checkpoint.save(tmp_path, host_state(r), {}, {})
    assert sorted(p.name for p in root.iterdir()) == [
        "round-000002", "round-000003", "round-000007.bak", "round-00001", "round-9999999",
        "round-abc"]
    state, _ = checkpoint.load_latest(tmp_path)
    assert state.round == 3


# --- 4. a non-finite model is never success -----------------------------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow it is about
def test_a_huge_outer_lr_is_divergence_not_success(tmp_path, capsys, scheduler):
    out = tmp_path / "out"
    rc = _train("--outer-lr", "1e300", "--checkpoint-every", "1", "--out", str(out),
                scheduler=scheduler)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 3, line
    assert "training diverged in round 0 (epoch 0): the averaged state's" in line
    assert "is NaN or Inf" in line
    assert not (out / "model.npz").exists() and not list(out.glob("checkpoints/round-*"))


NOT_FINITE = [
    (["--epochs", "inf"], "train.epochs must be a finite number, got inf"),
    (["--epochs", "nan"], "train.epochs must be a finite number, got nan"),
    (["--lr", "nan"], "train.lr must be a finite number, got nan"),
    (["--outer-lr", "inf"], "average.outer_lr must be a finite number, got inf"),
    (["--connect-timeout", "inf"], "cluster.connect_timeout must be a finite number, got inf"),
    (["--momentum=-inf"], "train.momentum must be a finite number, got -inf"),
    (["--epochs", "1e9"], "train.epochs must be <= 100000, got 1000000000.0"),
    (["--replicas", "100000"], "train.replicas must be <= 4096, got 100000"),
    (["--mix-every", "9" * 5000], "average.mix_every must be a positive step count"),
    (["--out", ""], "out must be a directory path (or None for no outputs), got ''"),
]


@pytest.mark.parametrize("args, message", NOT_FINITE, ids=[" ".join(a)[:30] for a, _ in NOT_FINITE])
def test_every_float_option_is_finite_and_in_range(tmp_path, capsys, scheduler, args, message,
                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out '' would mean here
    assert _train(*args, scheduler=scheduler) == 2
    assert message in _one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_the_plan_is_bounded_before_it_is_built(capsys, scheduler):
    rc = main(["train", "--data", "synthetic:5000:10", "--strategy", "single", "--batch-size",
               "1", "--mix-every", "1", "--epochs", "1000", "--no-progress", "--scheduler",
               scheduler])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "train.epochs 1000 makes 5000000 rounds" in line
    assert "a run is limited to 1000000 rounds" in line


# --- 8. one line, not a traceback ---------------------------------------------------------------


def test_a_garbage_metrics_line_drops_only_itself(run_copy, scheduler, capsys):
    path = run_copy / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "}{ garbage", '{"round": "x"}', *lines[1:]]) + "\n")
    # trained on to 2 epochs: the resume reads the metrics back and goes on after round 1
    assert main(["train", "--resume", str(run_copy), "--epochs", "2", "--scheduler",
                 scheduler]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 unreadable line(s) (line 2, 3)" in err
    assert [json.loads(x)["round"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


BAD_CONFIGS = [
    ("a string for an int", lambda c: c["train"].update(replicas="2"),
     "config.json: train.replicas must be an integer, got '2'"),
    ("a number for a section", lambda c: c.update(train=5),
     "config.json: train must be a section (a JSON object), got 5"),
    ("an unknown field", lambda c: c["train"].update(turbo=True),
     "config.json: config has unknown field train.turbo"),
    ("a list", lambda c: [1], "config.json: config must be a JSON object, got list"),
    ("infinity", lambda c: c["train"].update(epochs=float("inf")),
     "config.json: train.epochs must be a finite number, got inf"),
    ("a boolean for a float", lambda c: c["train"].update(lr=True),
     "config.json: train.lr must be a number, got True"),
]


@pytest.mark.parametrize("damage, message", [b[1:] for b in BAD_CONFIGS],
                         ids=[b[0] for b in BAD_CONFIGS])
def test_config_json_of_the_wrong_type_is_one_line(run_copy, scheduler, capsys, damage, message):
    saved = json.loads((run_copy / "config.json").read_text())
    changed = damage(saved)
    (run_copy / "config.json").write_text(json.dumps(saved if changed is None else changed))
    before = tree_bytes(run_copy)
    assert main(["train", "--resume", str(run_copy), "--scheduler", scheduler]) == 2
    assert message in _one_error_line(capsys.readouterr().err)
    assert tree_bytes(run_copy) == before


@pytest.mark.timeout(60)
def test_unreadable_config_json_kinds(run_copy, capsys):
    path = run_copy / "config.json"
    for make, message in ((lambda: path.write_text(_deep(100_000)), "config.json is unreadable"),
                          (lambda: os.mkfifo(path), "is a FIFO (named pipe)"),
                          (lambda: path.write_bytes(b"\xff\xfe"), "not UTF-8 text")):
        path.unlink()
        make()
        assert main(["train", "--resume", str(run_copy)]) == 2
        assert message in _one_error_line(capsys.readouterr().err)


def _no_space_for(name: str, monkeypatch):
    """os.fsync raises ENOSPC for files whose path contains ``name`` (a disk that fills there)."""
    real = os.fsync

    def fsync(fd):
        if name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("where, message", [
    (".model.npz.", "cannot write {out}/model.npz: No space left on device"),
    (".round-000000.", "cannot write checkpoint {out}/checkpoints/round-000000: No space left"),
])
def test_a_full_disk_is_one_line_naming_the_path_and_never_a_replay(tmp_path, capsys, scheduler,
                                                                   monkeypatch, where, message):
    out = tmp_path / "out"
    _no_space_for(where, monkeypatch)
    assert _train("--out", str(out), scheduler=scheduler) == 2
    err = capsys.readouterr().err
    assert message.format(out=out) in _one_error_line(err)
    assert "lost work" not in err and "replaying" not in err
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_memory_error_is_one_line(monkeypatch, capsys):
    from pipeline.data import datasets as data

    def too_big(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(data, "inspect_dataset", too_big)
    assert main(["inspect", "--data", "synthetic"]) == 1
    assert "out of memory" in _one_error_line(capsys.readouterr().err)


# --- 9. what resume trusts ----------------------------------------------------------------------


def test_resume_takes_the_cluster_section_from_the_command_line_not_the_directory(run_copy):
    saved = json.loads((run_copy / "config.json").read_text())
    saved["cluster"].update(scheduler="tcp://203.0.113.9:8786", dashboard_address="0.0.0.0:8787",
                            workers=64)
    (run_copy / "config.json").write_text(json.dumps(saved))
    cfg = config_from_args(build_parser().parse_args(["train", "--resume", str(run_copy)]))
    assert cfg.cluster == ClusterConfig()  # the defaults: nothing taken from the directory
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--resume", str(run_copy), "--workers", "1"]))
    assert cfg.cluster.workers == 1 and cfg.train.replicas == 2


def _meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


@pytest.mark.parametrize("field, value, message", [
    ("round", 0, "meta.json fails its SHA-256 check"),
    ("replicas", 1, "meta.json fails its SHA-256 check"),
    ("config", {}, "meta.json fails its SHA-256 check"),
])
def test_meta_json_is_inside_the_checksum(tmp_path, field, value, message):
    latest = checkpoint.save(tmp_path, HostState(3, [{"w": np.ones(2)}] * 2, [None] * 2, None),
                             {}, {"seed": 0})
    meta = _meta(latest)
    meta[field] = value
    (latest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ResumeError, match=message):
        checkpoint.verify(latest)
    meta["checksum"] = checkpoint.meta_checksum(meta)  # recomputed: still checked against
    (latest / "meta.json").write_text(json.dumps(meta))  # the directory and the state
    warnings = []
    assert checkpoint.load_latest(tmp_path, warn=warnings.append) is None or field == "config"
    if field != "config":
        assert {"round": "meta.json says round 0",
                "replicas": "unexpected entry 'params/1/w' for 1 replica(s)"}[field] in warnings[0]


def test_a_resumed_checkpoint_that_runs_code_is_refused(run_copy, scheduler, capsys):
    marker = run_copy.parent / "pwned"
    for ckpt in sorted((run_copy / "checkpoints").iterdir()):
        flat = npz.read(ckpt / "state.npz")
        name = next(iter(flat))
        flat[name] = np.array([_Touch(marker)], dtype=object)
        np.savez(ckpt / "state.npz", **flat)
        meta = _meta(ckpt)  # the attacker fixes every checksum
        meta["sha256"]["state.npz"] = checkpoint.sha256(ckpt / "state.npz")
        meta["checksum"] = checkpoint.meta_checksum(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))
    assert main(["train", "--resume", str(run_copy), "--scheduler", scheduler]) == 2
    err = capsys.readouterr().err
    assert "refused dtype '|O'" in err and "no readable checkpoint" in _one_error_line(err)
    assert not marker.exists()


class _Touch:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_of_other_shapes_is_refused_before_it_is_sent(run_copy, scheduler, capsys):
    for ckpt in (run_copy / "checkpoints").iterdir():
        flat = npz.read(ckpt / "state.npz")
        flat["params/0/fc/W"] = np.zeros((10, 7), np.float32)
        np.savez(ckpt / "state.npz", **flat)
        meta = _meta(ckpt)
        meta["sha256"]["state.npz"] = checkpoint.sha256(ckpt / "state.npz")
        meta["checksum"] = checkpoint.meta_checksum(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))
    assert main(["train", "--resume", str(run_copy), "--scheduler", scheduler]) == 2
    assert "does not fit the model: replica 0 'fc/W' is float32[10, 7], the model's is " \
           "float32[10, 512]" in _one_error_line(capsys.readouterr().err)


def test_resume_of_a_directory_without_our_marker(run_copy, capsys):
    (run_copy / fs.MARKER).unlink()
    assert main(["train", "--resume", str(run_copy)]) == 2
    assert "it has no .dask-chainer-run marker" in _one_error_line(capsys.readouterr().err)


def test_json_outputs_never_hold_nan(tmp_path, capsys):
    from pipeline.training import tasks
    params = tasks.init_params("small-cnn", 10, 0)
    path = tmp_path / "nan.npz"
    path.write_bytes(npz.to_bytes({k: np.full_like(v, np.nan) for k, v in params.items()}))
    assert main(["evaluate", "--model", "small-cnn", "--weights", str(path), "--data",
                 "synthetic:20:10"]) == 0
    out = capsys.readouterr().out

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")
    result = json.loads(out, parse_constant=no_constants)
    assert result["test_loss"] is None and result["n"] == 10


def test_cifar100_given_as_cifar10_is_recorded_as_what_it_is(tmp_path, scheduler):
    images, labels = cifar.synthetic_batch(0, "train", 0, 60)
    fine = (labels * 10 + np.arange(60) % 10).astype(np.int32)
    names = [f"c{i}" for i in range(100)]
    cifar.write_python100(str(tmp_path), (images, fine, fine // 5),
                          (images[:20], fine[:20], fine[:20] // 5), names, names[:20])
    out = tmp_path / "out"
    assert main(["train", "--data", str(tmp_path / "cifar-100-python"), "--strategy", "single",
                 "--batch-size", "16", "--epochs", "1", "--no-progress", "--scheduler", scheduler,
                 "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["n_classes"] == 100
    assert npz.read(out / "model.npz")["fc/W"].shape[0] == 100


def test_the_demo_touches_the_network_only_when_asked(monkeypatch, tmp_path):
    import socket

    from pipeline.cli import commands
    from pipeline.data import datasets as data

    def no_network(*args, **kwargs):
        raise AssertionError("the demo probed the network")
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "empty-cache"))
    said = []
    assert commands._demo_data(said.append, download=False) == "synthetic"
    assert "--download" in said[0]


def test_synth_never_replaces_a_file(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path), "--train", "10", "--test", "5", "--tar"]) == 0
    capsys.readouterr()
    before = tree_bytes(tmp_path)
    assert main(["synth", "--out", str(tmp_path), "--train", "10", "--test", "5", "--seed",
                 "1"]) == 2
    assert "already exists; writing a dataset never replaces files" in _one_error_line(
        capsys.readouterr().err)
    assert tree_bytes(tmp_path) == before


# --- hostile input, round three: nothing a run writes leaves OUT --------------------------------


@pytest.mark.parametrize("name", ["tensorboard", "dashboard.log", "metrics.csv", "checkpoints"])
def test_a_link_in_the_run_directory_is_refused_before_anything_is_written(run_copy, tmp_path,
                                                                          scheduler, capsys, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / name
    if name == "checkpoints":
        shutil.move(run_copy / name, target)
    os.symlink(target, run_copy / name)
    before = tree_bytes(run_copy)
    assert main(["train", "--resume", str(run_copy), "--epochs", "2", "--tensorboard", "--csv",
                 "--scheduler", scheduler]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (f"error: {run_copy / name}: is a symbolic link; a run writes only inside its "
                    "directory (remove the link)")
    assert tree_bytes(run_copy) == before
    assert not target.exists() or name == "checkpoints"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["sparse", "empty lines"])
def test_a_huge_or_sparse_metrics_file_is_refused_on_resume_without_reading_it(run_copy, scheduler,
                                                                              capsys, make):
    path = run_copy / "metrics.jsonl"
    if make == "sparse":
        with open(path, "r+b") as f:
            f.truncate(1 << 40)  # a terabyte of holes after the real lines
    else:
        path.write_bytes(path.read_bytes() + b"\n" * 10_000_000)
    size = path.stat().st_size
    assert main(["train", "--resume", str(run_copy), "--epochs", "2", "--scheduler",
                 scheduler]) == 2
    line = _one_error_line(capsys.readouterr().err)
    # the resumed plan has 4 rounds: 1 MiB + 4 x 64 KiB
    assert line == (f"error: {path}: {size} bytes is more than a run's log of 4 records can "
                    f"hold (at most {fs.lines_limit(4)} bytes)")


@pytest.mark.timeout(120)
def test_a_deflate_bomb_state_is_refused_before_it_is_inflated(run_copy, scheduler, capsys):
    """A state.npz whose extra member inflates to 256 MB from ~250 KB (checksums recomputed):
    refused from the sizes the archive declares, against what the model and K can hold."""
    import tracemalloc
    for ckpt in (run_copy / "checkpoints").iterdir():
        flat = npz.read(ckpt / "state.npz")
        flat["outer/zeros"] = np.zeros(1 << 28, np.uint8)
        np.savez_compressed(ckpt / "state.npz", **flat)
        del flat
        meta = _meta(ckpt)
        meta["sha256"]["state.npz"] = checkpoint.sha256(ckpt / "state.npz")
        meta["checksum"] = checkpoint.meta_checksum(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))
        assert (ckpt / "state.npz").stat().st_size < 2_000_000
    tracemalloc.start()
    try:
        assert main(["train", "--resume", str(run_copy), "--epochs", "2", "--scheduler",
                     scheduler]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert "more than a checkpoint of small-cnn with 2 replica(s) holds (at most " in err
    assert "refused before inflating any" in err
    assert "no readable checkpoint" in _one_error_line(err)
    assert peak < 64 << 20, peak


@pytest.mark.timeout(120)
def test_a_full_disk_under_tensorboard_ends_the_run_with_one_line(tmp_path, capsys, scheduler,
                                                                 monkeypatch):
    """tensorboardX's writer thread meets ENOSPC after its first events: the run ends with one
    line and exit 2 (it used to block forever in add_scalar), no replay, no traceback."""
    from tensorboardX import event_file_writer
    real, written = event_file_writer.EventsWriter.write_event, []

    def full(self, event):
        written.append(event)
        if len(written) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, event)
    monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", full)
    out = tmp_path / "out"
    assert _train("--out", str(out), "--tensorboard", "--epochs", "4",
                  scheduler=scheduler) == 2
    err = capsys.readouterr().err
    assert _one_error_line(err) == (f"error: cannot write {out / 'tensorboard'}: No space left "
                                    "on device")
    assert "lost work" not in err and "Exception in thread" not in err
