"""Checkpoints on disk: written to a temporary name and renamed, checksummed, verified on resume.

``OUT/checkpoints/round-000010/`` holds ``model.npz`` (the averaged model, loadable with
``chainer.serializers.load_npz`` alone), ``state.npz`` (every replica's parameters and optimizer
state, the outer optimizer's momentum) and ``meta.json`` (round, config, SHA-256 of both files).
A damaged latest checkpoint is skipped in favour of the one before it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pipeline.errors import ResumeError

KEEP = 2  # checkpoints kept; older ones are removed after a new one is complete


class HostState(NamedTuple):
    """The whole training state after round ``round`` (-1: before the first round), on the host."""
    round: int
    params: list  # per replica: dict[str, np.ndarray]
    opts: list  # per replica: dict[str, np.ndarray] or None
    outer: dict | None  # outer optimizer momentum buffer, or None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _flatten(state: HostState) -> dict:
    flat = {}
    for k, params in enumerate(state.params):
        flat.update({f"params/{k}/{name}": v for name, v in params.items()})
    for k, opt in enumerate(state.opts):
        if opt is not None:
            flat.update({f"opt/{k}/{name}": v for name, v in opt.items()})
    if state.outer is not None:
        flat.update({f"outer/{name}": v for name, v in state.outer.items()})
    return flat


def _unflatten(flat, round_index: int, replicas: int) -> HostState:
    params = [dict() for _ in range(replicas)]
    opts = [dict() for _ in range(replicas)]
    outer = {}
    for key in flat.files:
        kind, rest = key.split("/", 1)
        if kind == "outer":
            outer[rest] = flat[key]
        else:
            k, name = rest.split("/", 1)
            (params if kind == "params" else opts)[int(k)][name] = flat[key]
    return HostState(round_index, params, [o or None for o in opts], outer or None)


def _umask() -> int:
    """The process's umask: from /proc on Linux (no change to it, safe beside other threads),
    else by setting it and putting it back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` would give a new file or directory under the umask.

    ``tempfile`` creates 0600 files and 0700 directories (private scratch space); an output the
    user reads, copies and shares gets the usual mode instead, like every other file of the run.

    >>> oct(usual_mode()) in ("0o644", "0o664", "0o600", "0o640")
    True
    """
    return (0o777 if directory else 0o666) & ~_umask()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a whole file under a temporary name in the same directory, fsync, rename."""
    path = Path(path)
    mode = "w" if isinstance(data, str) else "wb"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, usual_mode())
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(out: str | Path, state: HostState, model_params: dict, config_dict: dict) -> Path:
    """Write checkpoint ``round-<round>`` atomically (a temporary directory renamed into place)."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{state.round:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        tmp.chmod(usual_mode(directory=True))
        np.savez(tmp / "model.npz", **model_params)
        np.savez(tmp / "state.npz", **_flatten(state))
        meta = dict(round=state.round, replicas=len(state.params), config=config_dict,
                    sha256={name: sha256(tmp / name) for name in ("model.npz", "state.npz")})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        for name in ("model.npz", "state.npz", "meta.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("round-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: Path) -> dict:
    """meta.json of a checkpoint directory after checking both checksums; ResumeError if damaged."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        for name, digest in meta["sha256"].items():
            if sha256(path / name) != digest:
                raise ResumeError(f"checkpoint {path} is damaged: {name} fails its SHA-256 check")
    except ResumeError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ResumeError(f"checkpoint {path} is unreadable: {exc}") from None
    return meta


def remove_temporaries(out: str | Path) -> list[str]:
    """Delete what a writer killed mid-write left behind: the hidden ``.NAME.*.tmp*`` files of
    ``write_atomic`` in ``out`` and the ``.round-*.tmp`` directories of ``save`` in
    ``out/checkpoints``. Returns the names removed, sorted.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / ".metrics.jsonl.x1.tmp").touch()
    >>> remove_temporaries(d), sorted(p.name for p in d.iterdir())
    (['.metrics.jsonl.x1.tmp'], [])
    """
    removed = []
    for directory in (Path(out), Path(out) / "checkpoints"):
        for path in directory.glob(".*.tmp*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)


def load_latest(out: str | Path, warn=None) -> tuple[HostState, dict] | None:
    """The newest checkpoint that verifies, falling back to older ones; None if there is none."""
    root = Path(out) / "checkpoints"
    for path in sorted(root.glob("round-*"), reverse=True):
        try:
            meta = verify(path)
            with np.load(path / "state.npz") as flat:
                return _unflatten(flat, meta["round"], meta["replicas"]), meta
        except (ResumeError, OSError, ValueError) as exc:
            if warn:
                warn(f"skipping checkpoint {path.name}: {exc}")
    return None
