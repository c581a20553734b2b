"""Resuming a run from its output directory: the checkpoint to go on from, whether it belongs to
this config, and the rounds still to run (``train --resume OUT [--epochs N]``).

Everything here reads files on the driver only, so a resume that cannot go on is refused before a
cluster starts or data is sent anywhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

from pipeline.outputs import checkpoint
from pipeline.core.state import HostState
from pipeline.core.errors import ResumeError
from pipeline.outputs.fs import has_checkpoint, read_json

# Top-level config fields that may differ between a run and its resume: where and how it runs and
# what it writes beside the metrics, never what it computes.
# anchor_every: anchors restart from the gathered state, the same bits (and config.json files
# from before it lack it).
RESUMABLE = frozenset({"cluster", "out", "progress", "tensorboard", "csv", "mlflow",
                       "anchor_every"})
# Fields a resume may change to train a run longer: ``--resume OUT --epochs N``; and fields the
# data decides (the class count: data.* is compared, and config.json records what the data said).
EXTENDABLE = frozenset({("train", "epochs"), ("model", "n_classes"), ("model", "input_size"),
                        ("data", "dataset")})
# How the replicas' mean travels between hosts: every averaging algorithm gives the same bits
# (pipeline.averaging.order), so a run may resume on another cluster with another one; likewise
# which workers train (results never depend on placement).
TRANSPORT = frozenset({("average", "algorithm"), ("average", "shards"), ("average", "link_gbps"),
                       ("train", "cpu_resource")})


class Resume(NamedTuple):
    """Where a resumed run goes on from."""
    state: HostState | None  # the latest readable checkpoint; None: the run stopped before its
    #                          first checkpoint, so it starts again from round 0
    saved: dict | None  # the config the checkpoint was written under (its epochs plan the
    #                     finished rounds)


def recorded(config) -> dict:
    """The config a checkpoint records (its meta.json ``config``): every field of the Config
    but where and how the run ran (RESUMABLE). The epochs stay, since a resume plans the
    finished rounds by them; :func:`must_match` is the part a resume compares."""
    return _without_resumable(config.to_dict())


def _without_resumable(config_dict: dict) -> dict:
    return {k: v for k, v in config_dict.items() if k not in RESUMABLE}


def must_match(config_dict: dict) -> dict:
    """The fields of a config dict that must be equal for a checkpoint to fit a run: those
    :func:`recorded` keeps, less the EXTENDABLE and TRANSPORT ones.

    >>> must_match({"seed": 1, "out": "x", "train": {"lr": 0.1, "epochs": 2}})
    {'seed': 1, 'train': {'lr': 0.1}}
    """
    kept = _without_resumable(config_dict)
    for section, key in EXTENDABLE | TRANSPORT:
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if k != key}
    return kept


def _with_defaults(saved: dict) -> dict:
    """``saved`` with the fields added since it was written at their defaults: a new field's
    default is the behaviour from before it (``train.lr_decay`` "none", ...)."""
    from pipeline.core.config import Config
    full = Config().to_dict()
    for section, value in full.items():
        if section not in saved:
            saved = {**saved, section: value}
        elif isinstance(value, dict) and isinstance(saved[section], dict):
            saved = {**saved, section: {**value, **saved[section]}}
    return saved


def check_same_run(saved: dict, now: dict, out: Path) -> None:
    """ResumeError naming the first field where the checkpoint's config and this run's differ;
    a field the checkpoint's config lacks (added since) counts at its default."""
    if not isinstance(saved, dict):
        raise ResumeError(f"{out}'s checkpoint holds no config (a {type(saved).__name__})")
    saved, now = must_match(_with_defaults(saved)), must_match(now)
    for section in sorted(set(saved) | set(now)):
        a, b = saved.get(section), now.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    raise ResumeError(f"{out} was written by a different run: {section}.{key} is "
                                      f"{a.get(key)!r} there and {b.get(key)!r} now")
        elif a != b:
            raise ResumeError(f"{out} was written by a different run: {section} is {a!r} there "
                              f"and {b!r} now")


def finished(out: Path) -> bool:
    """Whether ``out`` holds the outputs of a run that ran to its end."""
    try:
        return read_json(Path(out) / "summary.json", ResumeError).get("status", "done") == "done"
    except (ResumeError, AttributeError):
        return (Path(out) / "model.npz").exists()


def _state_bound(config_dict: dict) -> tuple | None:
    """``(max_bytes, what)`` for this run's checkpoints: from the model's size and K (None when
    the config names no model we can build: the resume fails on the config check instead)."""
    try:
        from pipeline.backends import get_backend
        model, k = config_dict["model"]["name"], int(config_dict["train"]["replicas"])
        params = get_backend(config_dict["model"].get("backend", "chainer")).init_params(
            model, int(config_dict["model"]["n_classes"]), 0)
    except Exception:  # noqa: BLE001  an unknown model or field: check_same_run names it
        return None
    size = sum(v.nbytes for v in params.values())
    return (checkpoint.state_budget(size, k),
            f"a checkpoint of {model} with {k} replica(s) holds")


def load(out: Path, config_dict: dict, log: Callable[[str], None]) -> Resume:
    """The state to resume ``out`` from, checked against this run's config ``config_dict``."""
    out = Path(out)
    if not has_checkpoint(out):
        if not (out / "config.json").is_file():
            raise ResumeError(f"nothing to resume in {out}: it holds no run (no config.json)")
        if finished(out):
            raise ResumeError(f"nothing to resume in {out}: it has no checkpoints/")
        log(f"{out} stopped before its first checkpoint: starting its run again from round 0")
        return Resume(None, None)
    found = checkpoint.load_latest(out, warn=log, bound=_state_bound(config_dict))
    if found is None:
        raise ResumeError(f"no readable checkpoint in {out / 'checkpoints'}")
    state, meta = found
    check_same_run(meta["config"], config_dict, out)
    return Resume(state, meta["config"])
