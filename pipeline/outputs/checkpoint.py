"""Checkpoints on disk: written to a temporary name and renamed, checksummed, verified on resume.

``OUT/checkpoints/round-000010/`` holds ``model.npz`` (the averaged model, loadable with
``pipeline.backends.chainer.state.load_npz``), ``state.npz`` (every replica's parameters and optimizer state, the
outer optimizer's momentum) and ``meta.json`` (round, replica count, config, SHA-256 of both
files, and a SHA-256 over all of that, so a changed round or replica count fails as a damaged
file does). A damaged latest checkpoint is skipped in favour of the one before it.

Everything read back goes through ``pipeline.core.npz`` and ``pipeline.core.files``: regular files only,
no pickles, sizes checked before allocation. Only ``round-NNNNNN`` directories are read or pruned.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from pipeline.core.state import HostState  # noqa: F401  (also its old home)
from pipeline.core import arrays, npz
from pipeline.core.config_train import MAX_REPLICAS  # replicas a checkpoint may hold
from pipeline.core.errors import OutputError, ResumeError, one_line
from pipeline.core.files import MIB, open_regular, os_reason, read_text
from pipeline.outputs.fs import checkpoint_dirs

KEEP = 2  # checkpoints kept; older ones are removed after a new one is complete
MAX_META_BYTES = 16 * MIB  # meta.json: the config and two digests, ~2 KB


def sha256(path: Path, error: type[Exception] = ResumeError) -> str:
    digest = hashlib.sha256()
    with open_regular(path, error) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def meta_checksum(meta: dict) -> str:
    """SHA-256 of every field of meta.json but the checksum itself, in a canonical JSON form.

    >>> meta_checksum({"round": 3, "replicas": 2}) == meta_checksum({"replicas": 2, "round": 3})
    True
    """
    body = {k: v for k, v in meta.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


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


def _unflatten(flat: dict, round_index: int, replicas: int, where: Path) -> HostState:
    params = [dict() for _ in range(replicas)]
    opts = [dict() for _ in range(replicas)]
    outer = {}
    for key, value in flat.items():
        kind, _, rest = key.partition("/")
        if kind == "outer" and rest:
            outer[rest] = value
            continue
        k, _, name = rest.partition("/")
        if kind not in ("params", "opt") or not name or not k.isdigit() or int(k) >= replicas:
            raise ResumeError(f"{where}: unexpected entry {key[:80]!r} for {replicas} replica(s)")
        (params if kind == "params" else opts)[int(k)][name] = value
    if any(not p for p in params):
        raise ResumeError(f"{where}: holds no parameters for replica "
                          f"{next(i for i, p in enumerate(params) if not p)}")
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


STATE_COPIES = 4  # a replica's params, at most 2 optimizer slots (Adam), and slack


def state_budget(model_bytes: int, replicas: int) -> int:
    """The most bytes a checkpoint's ``state.npz`` of a model of ``model_bytes`` and ``replicas``
    replicas holds: per replica (and the async server, and the outer state) the params and up to
    two optimizer slots, each of the model's size; plus 1 MiB of scalars and schedules.

    >>> state_budget(1000, 2)
    1064576
    """
    return STATE_COPIES * model_bytes * (replicas + 2) + (1 << 20)


def check_state(state: HostState, template: dict, where: str) -> None:
    """ResumeError unless every replica's params have the template's names, shapes and dtypes,
    and the optimizer and outer state fit them (a checkpoint of another model or a crafted one
    would otherwise fail inside a worker, far from its cause)."""
    def fail(what: str):
        raise ResumeError(f"checkpoint {where} does not fit the model: {what}")

    for k, params in enumerate(state.params):
        if params.keys() != template.keys():
            fail(f"replica {k} holds {sorted(params.keys() ^ template.keys())[0]!r}, "
                 "which the model does not have or does")
        for name, value in params.items():
            if value.shape != template[name].shape or value.dtype != template[name].dtype:
                fail(f"replica {k} {name!r} is {value.dtype}{list(value.shape)}, the model's "
                     f"is {template[name].dtype}{list(template[name].shape)}")
    for k, opt in enumerate(state.opts):
        for name, value in (opt or {}).items():
            _check_slot(name, value, template, lambda what: fail(f"replica {k} optimizer {what}"))
    for name, value in (state.outer or {}).items():  # an outer momentum, or a schedule (async)
        ref = template.get(name)
        if ref is not None and (value.shape != ref.shape or value.dtype.kind != "f"):
            fail(f"outer momentum {name!r} does not match the model")
        if ref is None and (value.dtype.kind not in "iu" or value.size > 1 << 16):
            fail(f"outer entry {name!r} is neither a parameter's momentum nor a small counter")


def _check_slot(name: str, value: np.ndarray, template: dict, fail) -> None:
    """An optimizer entry: a counter ("t", "epoch", "<param>/t") or a slot ("<param>/v")."""
    if name in ("t", "epoch") or name.endswith("/t"):
        if value.size != 1 or value.ndim > 1 or value.dtype.kind not in "iu":  # () or (1,)
            fail(f"counter {name!r} is not an integer scalar")
        return
    param, _, slot = name.rpartition("/")
    ref = template.get(param)
    if ref is None or not slot or value.shape != ref.shape or value.dtype.kind != "f":
        fail(f"entry {name!r} does not match a parameter of the model")


def first_nonfinite(state: HostState) -> str | None:
    """Where the first NaN or Inf of a host state is (``"conv1/W"``, ``"outer conv1/W"``), or
    None; each distinct array is scanned once (ipm's replicas share one dict).

    >>> s = HostState(0, [{"W": np.ones(2)}], [None], {"W": np.array([0.0, np.inf])})
    >>> first_nonfinite(s)
    'outer W'
    """
    seen = set()
    parts = [("", p) for p in state.params] + [("optimizer ", o) for o in state.opts if o] + \
        ([("outer ", state.outer)] if state.outer else [])
    for label, entries in parts:
        if id(entries) in seen:
            continue
        seen.add(id(entries))
        name = arrays.first_nonfinite(entries)
        if name is not None:
            return f"{label}{name}"
    return None


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a whole file under a temporary name in the same directory, fsync, rename.

    A failure (a full disk) leaves the old file and no temporary, and raises OutputError
    naming the path.
    """
    path = Path(path)
    mode = "w" if isinstance(data, str) else "wb"
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {os_reason(exc)}") from None
    try:
        os.fchmod(fd, usual_mode())
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {os_reason(exc)}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(out: str | Path, state: HostState, model_params: dict, config_dict: dict) -> Path:
    """Write checkpoint ``round-<round>`` atomically (a temporary directory renamed into place).

    Then prunes: of the other ``round-NNNNNN`` directories, those older than this one beyond
    the newest ``KEEP - 1``, and any newer one (left by a run that this one replays). OutputError
    (nothing half-written left) when the disk refuses.
    """
    root = Path(out) / "checkpoints"
    final = root / f"round-{state.round:06d}"
    if root.is_symlink():  # writing and pruning happen in the run directory, nowhere else
        raise OutputError(f"cannot write checkpoint {final}: {root} is a symbolic link")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint {final}: {os_reason(exc)}") from None
    try:
        tmp.chmod(usual_mode(directory=True))
        np.savez(tmp / "model.npz", **model_params)  # streamed: a K=64 state is gigabytes
        np.savez(tmp / "state.npz", **_flatten(state))
        meta = dict(round=state.round, replicas=len(state.params), config=config_dict,
                    sha256={name: sha256(tmp / name) for name in ("model.npz", "state.npz")})
        meta["checksum"] = meta_checksum(meta)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True,
                                                  allow_nan=False))
        for name in ("model.npz", "state.npz", "meta.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write checkpoint {final}: {os_reason(exc)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, state.round)
    return final


def _prune(root: Path, current: int) -> None:
    found = [(r, p) for r, p in checkpoint_dirs(root) if r != current]
    older = [p for r, p in found if r < current]
    stale = older[:max(0, len(older) - (KEEP - 1))] + [p for r, p in found if r > current]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def verify(path: Path) -> dict:
    """meta.json of a checkpoint directory after checking its checksums; ResumeError if damaged."""
    text = read_text(path / "meta.json", MAX_META_BYTES, "a checkpoint's meta.json", ResumeError)
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ResumeError(f"checkpoint {path} is unreadable: meta.json is not JSON "
                          f"({one_line(exc, kind=False, limit=80)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict) \
            or not isinstance(meta.get("checksum"), str):
        raise ResumeError(f"checkpoint {path} is unreadable: meta.json lacks its checksums "
                          "(damaged, or written by a version before meta.json was checksummed)")
    if meta_checksum(meta) != meta["checksum"]:
        raise ResumeError(f"checkpoint {path} is damaged: meta.json fails its SHA-256 check")
    if meta["sha256"].keys() != {"model.npz", "state.npz"}:
        raise ResumeError(f"checkpoint {path} is unreadable: meta.json names other files")
    for name, digest in meta["sha256"].items():
        if sha256(path / name) != digest:
            raise ResumeError(f"checkpoint {path} is damaged: {name} fails its SHA-256 check")
    r, k = meta.get("round"), meta.get("replicas")
    if type(r) is not int or f"round-{r:06d}" != path.name:
        raise ResumeError(f"checkpoint {path} is damaged: meta.json says round {r!r}")
    if type(k) is not int or not 1 <= k <= MAX_REPLICAS or not isinstance(meta.get("config"), dict):
        raise ResumeError(f"checkpoint {path} is damaged: meta.json says {k!r} replicas")
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
        if directory.is_symlink():
            continue  # only ever inside the run directory
        for path in directory.glob(".*.tmp*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)


def load_latest(out: str | Path, warn=None, bound: tuple | None = None
                ) -> tuple[HostState, dict] | None:
    """The newest checkpoint that verifies, falling back to older ones; None if there is none.

    ``bound``: ``(max_bytes, what)``, the most a state may hold (from the model and K,
    :func:`state_budget`), checked before its arrays are inflated."""
    max_bytes, what = bound or (None, "")
    for _, path in reversed(checkpoint_dirs(Path(out) / "checkpoints")):
        try:
            meta = verify(path)
            flat = npz.read(path / "state.npz", error=ResumeError, max_bytes=max_bytes,
                            what=what)
            return _unflatten(flat, meta["round"], meta["replicas"], path / "state.npz"), meta
        except (ResumeError, npz.Mismatch, OSError) as exc:
            if warn:
                warn(f"skipping checkpoint {path.name}: {exc}")
    return None
