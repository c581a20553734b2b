"""Command-line options built from the config fields' metadata, and their --help text.

A config field declared with ``opt(..., flag="--x")`` (pipeline.core.config) is an option; its
help, metavar, unit and choices are the field's. What the CLI adds comes from the code that owns
it: registry names (models, strategies, augmentation policies), the strategies' plain values and
recipes for the fields left open (``Strategy.PLAIN``, ``Strategy.recipe``), the image size the
readers default to. Help that reads a registry is written only when --help is shown: an option's
``help`` is a callable until then (``pipeline.cli.parser._Parser.format_help`` calls it), so
``synth`` or ``fetch`` never import Chainer.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from typing import Callable, NamedTuple

from pipeline.core.config import Config
from pipeline.core.config_train import OPTIMIZERS

_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


class Option(NamedTuple):
    """A config field that is a command-line option."""
    dest: str  # the dotted field name, as Config.replace takes it: "train.lr", "seed"
    field: dataclasses.Field

    @property
    def flag(self) -> str:
        return self.field.metadata["flag"]

    @property
    def kind(self) -> type:
        """The value's type: the first of int, float, str or bool in the field's type."""
        names = self.field.type
        names = names.__name__ if isinstance(names, type) else str(names)
        return next(_KINDS[k.strip()] for k in names.split("|") if k.strip() in _KINDS)


def options(cls=Config, prefix: str = "") -> list[Option]:
    """The fields of ``cls`` and of its sections that declare a flag, in declaration order.

    >>> [o.dest for o in options()][:3]
    ['data.source', 'data.download', 'data.image_size']
    """
    found = []
    for f in dataclasses.fields(cls):
        section = f.default_factory
        if dataclasses.is_dataclass(section):
            found += options(section, f"{prefix}{f.name}.")
        elif f.metadata.get("flag"):
            found.append(Option(prefix + f.name, f))
    return found


def pick(*dests: str) -> list[Option]:
    """The options of ``Config`` named ``dests``, in that order."""
    by_dest = {o.dest: o for o in options()}
    return [by_dest[d] for d in dests]


def add_options(parser, opts: list[Option], grouped: bool = False, frame: str = "{}",
                required: tuple = (), first: tuple = ()) -> None:
    """Add ``opts`` to ``parser``, unset (None) unless given, so a resume can tell them from the
    saved config's values; ``grouped`` puts each section under its own heading, ``frame``
    frames the default that --help shows ("from config.json, else {}"); the options named in
    ``required`` (dests) must be given and show no default; those in ``first`` (dests) open the
    help under "most used", the rest under their sections."""
    groups = {}
    if first:
        groups[None] = parser.add_argument_group("most used (the rest by config section below)")
        # argparse prints groups in creation order and made its own two first: move ours up
        parser._action_groups.insert(0, parser._action_groups.pop())
    for o in sorted(opts, key=lambda o: o.dest not in first):
        section = o.dest.rpartition(".")[0]
        target = parser
        if o.dest in first:
            target = groups[None]
        elif grouped and section:
            if section not in groups:
                groups[section] = parser.add_argument_group(f"{section} (config section)")
            target = groups[section]
        action = _add(target, o)
        action.required = o.dest in required
        shown = None if action.required else frame
        action.help = defer(functools.partial(help_text, o, shown))


def _add(target, o: Option) -> argparse.Action:
    if o.kind is not bool:
        return target.add_argument(o.flag, dest=o.dest, type=o.kind, default=None,
                                   metavar=o.field.metadata["metavar"])
    if o.field.default is True:  # on by default: --x and --no-x
        return target.add_argument(o.flag, dest=o.dest, default=None,
                                   action=argparse.BooleanOptionalAction)
    return target.add_argument(o.flag, dest=o.dest, action="store_const", const=True,
                               default=None)


def given(args: argparse.Namespace, opts: list[Option]) -> dict:
    """{dest: value} of the options in ``opts`` that the command line set."""
    values = {o.dest: getattr(args, o.dest, None) for o in opts}
    return {d: v for d, v in values.items() if v is not None}


def section_given(args: argparse.Namespace, opts: list[Option], section: str) -> dict:
    """{field: value} of the options of one config section that the command line set."""
    return {d.partition(".")[2]: v for d, v in given(args, opts).items()
            if d.partition(".")[0] == section}


# ---- --set section.field=VALUE and --config FILE: every field, flag or not ---------------------

def fields(cls=Config, prefix: str = "") -> dict:
    """{dotted name: dataclasses.Field} of every config field, sections included.

    >>> names = fields(); "data.split_seed" in names and "train.lr" in names and "seed" in names
    True
    """
    found = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            found.update(fields(f.default_factory, f"{prefix}{f.name}."))
        else:
            found[prefix + f.name] = f
    return found


_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def parse_set(text: str) -> tuple[str, object]:
    """``"section.field=VALUE"`` -> ``(dest, value)``, the value read as the field's type
    (``none``/``null`` for a field that may be None; true/false, on/off for switches).

    >>> parse_set("data.split_seed=3"), parse_set("train.beta1=none"), parse_set("csv=on")
    (('data.split_seed', 3), ('train.beta1', None), ('csv', True))
    >>> parse_set("average.mix_every=2ep")
    ('average.mix_every', '2ep')
    """
    name, sep, raw = text.partition("=")
    name = name.strip()
    known = fields()
    if not sep or name not in known:
        import difflib
        close = [n for n in known if n.split(".")[-1] == name] or \
            difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else " (python -m pipeline train --help "             "lists the sections; config.json shows every field)"
        raise ValueError(f"--set {text[:60]!r}: expected SECTION.FIELD=VALUE with a config "
                         f"field{hint}" if sep else f"--set {text[:60]!r}: expected "
                         f"SECTION.FIELD=VALUE")
    kinds = [k.strip() for k in str(known[name].type).split("|")]
    value = raw.strip()
    if "None" in kinds and value.lower() in ("none", "null"):
        return name, None
    for kind in kinds:
        parsed = _parse(value, kind)
        if parsed is not None:
            return name, parsed
    words = " or ".join({"int": "an integer", "float": "a number", "bool": "true or false",
                         "str": "a string", "None": "none"}[k] for k in kinds)
    raise ValueError(f"--set {name}: {value[:60]!r} is not {words}")


def _parse(value: str, kind: str):
    """``value`` as ``kind``, or None where it is not one."""
    if kind == "str":
        return value
    if kind == "bool":
        low = value.lower()
        return True if low in _TRUE else False if low in _FALSE else None
    try:
        return int(value) if kind == "int" else float(value) if kind == "float" else None
    except ValueError:
        return None


def defer(make: Callable[[], str]) -> Callable[[], str]:
    """Help written by ``make`` when --help is shown, ``%`` kept literal."""
    return lambda: make().replace("%", "%%")


# ---- the help text ----------------------------------------------------------------------------

def help_text(o: Option, frame: str | None = "{}") -> str:
    """The field's help, its choices first, its default last (none with ``frame`` None).

    >>> help_text(pick("train.batch_size")[0])
    "images per replica per step (B); gradient's global batch is K x B (default: 64 images)"
    """
    text = o.field.metadata["help"]
    names = choices(o.dest, o.field.metadata["choices"])
    if names:
        text = f"{' | '.join(names)}: {text}"
    if o.dest == "train.recipe":  # what the switch turns off, from the strategies
        text += f" (recipes: {recipe_summary()})"
    return text if frame is None else f"{text} (default: {frame.format(default_text(o))})"


def _registries() -> dict:
    """Fields whose values are names in a registry: {dest: () -> names}."""
    def models():
        from pipeline.backends import get_backend
        return get_backend().model_names()

    def strategies():
        from pipeline.training.strategies import NAMES
        return NAMES

    def policies():
        from augment import POLICIES
        return tuple(POLICIES)

    def algorithms():
        from pipeline.averaging.algorithms import names
        return names()

    return {"model.name": models, "train.strategy": strategies, "augment.policy": policies,
            "average.algorithm": algorithms}


def choices(dest: str, declared: tuple = ()) -> tuple:
    """The names ``dest`` accepts: its registry's, else the field's declared choices.

    >>> choices("train.strategy")
    ('single', 'gradient', 'mixture', 'ipm', 'async')
    """
    registry = _registries().get(dest)
    return registry() if registry else tuple(declared)


def _resolved_below() -> dict:
    """Fields whose None the code below the CLI resolves: {dest: () -> value}."""
    def image_size():
        from pipeline.data.images import DEFAULT_SIZE
        return DEFAULT_SIZE

    return {"data.image_size": image_size}


def default_text(o: Option) -> str:
    """What the option is when not given: the field's default, or what resolves it."""
    value, meta = o.field.default, o.field.metadata
    below = _resolved_below().get(o.dest)
    if below:
        return shown(below(), meta["unit"])
    if value in (None, "auto") and o.dest in _plain():
        return strategy_default(o.dest, meta["unit"])
    if value is None:
        return meta["none"] or "none"
    return shown(value, meta["unit"])


def shown(value, unit: str = "") -> str:
    """A value as --help writes it.

    >>> shown(2.0, "epochs"), shown(1, "rounds"), shown(1e-8), shown(True)
    ('2 epochs', '1 round', '1e-8', 'on')
    """
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        value = int(value) if value.is_integer() else re.sub(r"e([+-])0*(\d)", r"e\1\2",
                                                              f"{value:g}").replace("e+", "e")
    if value == 1 and unit.endswith("s") and len(unit) > 1:
        unit = unit[:-1]  # "1 round", "1 thread"
    return f"{value} {unit}".strip()


# ---- the strategies' defaults -------------------------------------------------------------------

def _plain() -> dict:
    from pipeline.training.strategies.base import Strategy
    return Strategy.PLAIN


def _flat(config: Config) -> dict:
    """{dotted name: value} of every field of a config."""
    flat = {}
    for name, value in config.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            flat[name] = value
    return flat


@functools.cache
def recipe_cases() -> tuple:
    """((strategy, K, optimizer, {dest: value}), ...): where a strategy's recipe fills a field
    otherwise than its plain values do, probed at K = 1 and K = 2 (for any K > 1) with each
    optimizer, the settings the recipes read."""
    from pipeline.training import strategies
    cases = []
    for name in strategies.NAMES:
        cls = strategies.get(name)
        for k in (1, 2):
            for optimizer in OPTIMIZERS:
                cfg = Config().replace(**{"train.strategy": name, "train.replicas": k,
                                          "train.optimizer": optimizer})
                on = _flat(cls.resolve(cfg))
                off = _flat(cls.resolve(cfg.replace(**{"train.recipe": False})))
                off["train.recipe"] = True  # what the recipe changes, not the switch itself
                changed = {d: v for d, v in on.items() if v != off[d]}
                if changed:
                    cases.append((name, k, optimizer, changed))
    return tuple(cases)


def _condition(points: set) -> str:
    """'with K > 1 and adam' for the (K, optimizer) points a recipe applies at."""
    ks = {k for k, _ in points}
    optimizers = [o for o in OPTIMIZERS if any(p == o for _, p in points)]
    if points != {(k, o) for k in ks for o in optimizers}:
        return "in some settings"
    parts = [{frozenset({2}): "K > 1", frozenset({1}): "K = 1"}.get(frozenset(ks), "")]
    if len(optimizers) < len(OPTIMIZERS):
        parts.append(" or ".join(optimizers))
    parts = [p for p in parts if p]
    return f"with {' and '.join(parts)}" if parts else ""


def _by_strategy(cases) -> dict:
    """{(condition, value): 'ipm and async'} of cases (strategy, K, optimizer, value)."""
    points = {}
    for name, k, optimizer, value in cases:
        points.setdefault((name, value), set()).add((k, optimizer))
    grouped = {}
    for (name, value), at in points.items():
        grouped.setdefault((_condition(at), value), []).append(name)
    return {key: _and(names) for key, names in grouped.items()}


def _and(names: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def strategy_default(dest: str, unit: str = "") -> str:
    """'1 epoch for ipm and async with K > 1 and adam, else 0 epochs': the plain value of an
    open field and where a strategy's recipe differs."""
    cases = [(n, k, o, changed[dest]) for n, k, o, changed in recipe_cases() if dest in changed]
    parts = [f"{shown(value, unit)} for {names} {cond}".strip()
             for (cond, value), names in _by_strategy(cases).items()]
    plain = shown(_plain()[dest], unit)
    return f"{', '.join(parts)}, else {plain}" if parts else plain


def recipe_summary() -> str:
    """'ipm with K > 1 and adam: --warmup-epochs 1, --optimizer-state average; ...'."""
    flags = {o.dest: o.flag for o in options()}
    cases = [(n, k, o, tuple(sorted(changed.items()))) for n, k, o, changed in recipe_cases()]
    parts = []
    for (cond, changed), names in _by_strategy(cases).items():
        settings = ", ".join(f"{flags.get(d, d)} {shown(v)}" for d, v in changed)
        parts.append(f"{names} {cond}: {settings}")
    return "; ".join(parts) or "none"
