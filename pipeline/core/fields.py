"""How a config field is declared and checked: ``opt`` (the field's one description: help, flag,
unit, choices) and the checks every section's ``validate`` uses, each raising a ValueError that
names the field."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from dataclasses import field

IMPORT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
                         r":[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def opt(default, help: str, *, flag: str | None = None, metavar: str | None = None,
        unit: str = "", none: str | None = None, choices: tuple = ()):
    """A config field with its one description: ``help`` (meaning, and what None or "auto"
    stands for), ``unit`` of its value and the ``choices`` its validation accepts. With ``flag``
    it is also an option of ``python -m pipeline train`` (pipeline.cli.options builds them);
    ``none`` is the default --help shows for None.

    >>> opt(0, "run seed", flag="--seed").metadata["flag"]
    '--seed'
    """
    return field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar,
                                            "unit": unit, "none": none, "choices": choices})


def check(condition: bool, name: str, message: str, value) -> None:
    if not condition:
        raise ValueError(f"{name} {message}, got {short(value)}")


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_kind(value, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, str)


WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "None": "null"}


def check_types(section, prefix: str) -> None:
    """Every field of a section has its declared type (``int``, ``float | None``, ...) and every
    number is finite: config.json on a resume is input like any other."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        name = f"{prefix}{f.name}"
        if not any(is_kind(value, kind) for kind in kinds):
            raise ValueError(f"{name} must be {' or '.join(WORDS[k] for k in kinds)}, "
                             f"got {short(value)}")
        if isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {short(value)}")


def in_range(value, lo, hi, name: str, closed_lo: bool = True, closed_hi: bool = True) -> None:
    ok = (lo <= value if closed_lo else lo < value) and (value <= hi if closed_hi else value < hi)
    check(ok, name, f"must be in {'[' if closed_lo else '('}{lo:g}, {hi:g}"
                     f"{']' if closed_hi else ')'}", value)


def is_tracking_uri(text: str) -> bool:
    """Whether ``text`` names an MLflow tracking server: http(s)://HOST[:PORT][/path] (the form
    of --mlflow; a file store or Databricks is MLflow's own client's business).

    >>> [is_tracking_uri(u) for u in ("http://127.0.0.1:5000", "file:///x", "http://")]
    [True, False, False]
    """
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(text)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number
        return False


def is_json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object (the form of --model-args and --optimizer-args).

    >>> is_json_object('{"width": 2}'), is_json_object("[1]"), is_json_object("{")
    (True, False, False)
    """
    try:
        return isinstance(json.loads(text), dict) and len(text) <= 100_000
    except (ValueError, RecursionError):
        return False


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the form of an import path ``pkg.module:factory`` (the user's model
    or optimizer, recorded in ``model.name`` / ``train.optimizer``).

    >>> is_import_path("mymodels.nets:Net"), is_import_path("small-cnn"), is_import_path("os:")
    (True, False, False)
    """
    return isinstance(name, str) and bool(IMPORT_PATH.match(name))
