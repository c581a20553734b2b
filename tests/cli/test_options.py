"""The command-line options come from the config fields, their choices and defaults from the code
that owns them (registries, strategies), and the README names only options that exist."""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import options
from pipeline.cli.parser import build_parser, main
from pipeline.core.fields import opt

# Every option `train` had before its options were built from the fields: none may go.
TRAIN_FLAGS = """--data --image-size --val-fraction --val-data --image-root --cache --model
--cpu-kernels --strategy --replicas --mix-every --epochs --batch-size --optimizer --lr --momentum
--weight-decay --lr-scaling --warmup-epochs --lr-decay --outer-lr --outer-momentum
--optimizer-state --fan-in --average --shards --link-gbps --augment --beta1 --beta2 --adam-eps
--outer-warmup-epochs --async-order --max-staleness --staleness-scaling --async-push
--replay-updates --prefetch --seed --checkpoint-every --anchor-every --eval-every --device
--gpu-resource --cpu-resource --loader-workers --gpu-workers-per-device --gpu-threads --workers
--threads-per-worker --dashboard-address --scheduler --tls-ca-file --tls-cert --tls-key
--connect-timeout --stall-report --stall-retire --stall-min-seconds --no-recipe --adaptive-outer
--pin-replicas --no-pin-replicas --tta --download --out --resume --overwrite --tensorboard --csv
--no-progress""".split()


def _help(capsys, *command: str) -> str:
    """The --help of ``command``, whitespace collapsed."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.fixture(autouse=True)
def _unwrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps help at the terminal's width


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_option_train_had_is_still_there():
    flags = {s for a in _subparser("train")._actions for s in a.option_strings}
    assert set(TRAIN_FLAGS) <= flags


def test_every_field_with_a_flag_is_an_option_with_the_fields_help(capsys):
    text = _help(capsys, "train")
    for o in options.options():
        help_ = " ".join(o.field.metadata["help"].split())
        assert re.search(rf"{re.escape(o.flag)}\b[^-]", text), o.flag
        assert help_ in text, o.dest
    dests = [o.dest for o in options.options()]
    flags = [o.flag for o in options.options()]
    assert len(set(dests)) == len(dests) and len(set(flags)) == len(flags)


def test_a_field_declared_with_a_flag_becomes_an_option():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        rate: float = opt(0.5, "how fast", flag="--rate", metavar="R", unit="Hz")
        hidden: int = opt(3, "no flag: config only")
        loud: bool = opt(False, "say more", flag="--loud")
        quiet: bool = opt(True, "say less", flag="--quiet")

    @dataclasses.dataclass(frozen=True)
    class Whole:
        extra: Extra = dataclasses.field(default_factory=Extra)
        seed: int | None = opt(None, "a seed", flag="--seed", metavar="N", none="random")

    found = options.options(Whole)
    assert [o.dest for o in found] == ["extra.rate", "extra.loud", "extra.quiet", "seed"]
    assert [options.help_text(o) for o in found] == [
        "how fast (default: 0.5 Hz)", "say more (default: off)", "say less (default: on)",
        "a seed (default: random)"]
    parser = argparse.ArgumentParser()
    options.add_options(parser, found, grouped=True)
    args = parser.parse_args(["--rate", "2", "--loud", "--no-quiet"])
    assert options.given(args, found) == {"extra.rate": 2.0, "extra.loud": True,
                                          "extra.quiet": False}
    assert options.section_given(parser.parse_args([]), found, "extra") == {}


def test_unset_options_are_none_so_a_resume_keeps_the_saved_values():
    args = build_parser().parse_args(["train"])
    assert options.given(args, options.options()) == {}
    args = build_parser().parse_args(["train", "--no-recipe", "--no-progress", "--tta",
                                      "--adaptive-outer", "--replicas", "2", "--mix-every", "1ep"])
    assert options.given(args, options.options()) == {
        "train.recipe": False, "progress": False, "train.tta": True,
        "average.adaptive_outer": True, "train.replicas": 2, "average.mix_every": "1ep"}


def test_evaluate_help_lists_every_registered_model(capsys):
    from pipeline.backends.chainer.models import MODELS
    from pipeline.backends.chainer.user_models import ZOO
    text = _help(capsys, "evaluate")
    listed = re.search(r"--model NAME model of --weights: (.*?), or pkg.module:factory",
                       text).group(1)
    assert listed.split(" | ") == [*MODELS, *ZOO]


def test_train_help_lists_every_model_strategy_and_policy_of_the_registries(capsys):
    from augment import POLICIES

    from pipeline.backends.chainer.models import MODELS
    from pipeline.backends.chainer.user_models import ZOO
    from pipeline.training.strategies import NAMES
    text = _help(capsys, "train")
    for flag, names in (("--model NAME", [*MODELS, *ZOO]), ("--strategy NAME", NAMES),
                        ("--augment POLICY", POLICIES)):
        assert f"{flag} {' | '.join(names)}: " in text, flag


def test_strategy_defaults_come_from_the_strategies(capsys):
    from pipeline.training.strategies.base import Strategy
    text = _help(capsys, "train")
    cases = options.recipe_cases()
    for o in options.options():
        if o.dest not in Strategy.PLAIN:
            continue
        shown = options.default_text(o)
        assert f"(default: {shown})" in text
        assert shown.endswith(options.shown(Strategy.PLAIN[o.dest], o.field.metadata["unit"]))
        for name, _, _, changed in cases:
            if o.dest in changed:
                assert name in shown and options.shown(changed[o.dest]) in shown, (o.dest, name)


def test_a_recipe_shows_up_where_it_applies(monkeypatch):
    from pipeline.training import strategies
    from pipeline.training.strategies.base import Strategy

    class Fast(Strategy):
        name = "fast"

        @classmethod
        def recipe(cls, config):
            return {"train.beta1": 0.5} if config.train.optimizer == "sgd" else {}

    monkeypatch.setattr(strategies, "NAMES", ("single", "fast"))
    monkeypatch.setattr(strategies, "get", {"single": Strategy, "fast": Fast}.get)
    options.recipe_cases.cache_clear()
    try:
        assert options.strategy_default("train.beta1") == "0.5 for fast with sgd, else 0.9"
        assert options.strategy_default("train.beta2") == "0.999"
        assert options.recipe_summary() == "fast with sgd: --beta1 0.5"
    finally:
        options.recipe_cases.cache_clear()


def test_no_recipe_help_names_what_the_recipes_change(capsys):
    text = _help(capsys, "train")
    recipes = re.search(r"\(recipes: ([^()]*)\)", text).group(1)
    assert recipes == options.recipe_summary() and "--warmup-epochs" in recipes


def test_building_the_parser_imports_no_chainer_and_no_strategies():
    code = ("import sys; from pipeline.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('chainer', "
            "'pipeline.training', 'pipeline.backends'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2]).stdout
    assert out.strip() == "[]"


def test_the_readme_names_only_options_that_exist():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    other_tools = {"--logdir", "--no-build-isolation",  # tensorboard's, pip's
                   "--host", "--port", "--backend-store-uri", "--artifacts-destination"}  # mlflow's
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", readme)) - other_tools
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = {s for p in [parser, *sub.choices.values()] for a in p._actions
             for s in a.option_strings}
    assert named - known == set()


@pytest.mark.parametrize("dest", ["model.name", "train.strategy", "augment.policy"])
def test_a_registry_field_describes_all_of_its_names_or_none(dest):
    """The names of a registry field (``--model``, ``--strategy``, ``--augment``) are generated
    into its help; where the field's own text describes names too, it describes every one, so a
    new model, strategy or policy cannot be left out of the description (as evaluate's list of
    models once was)."""
    field = next(o.field for o in options.options() if o.dest == dest)
    text = field.metadata["help"]
    names = options.choices(dest)
    described = [n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    assert described in ([], list(names)), f"{dest}: describes {described} of {list(names)}"


# Options of other commands that share a config field's flag but mean something else there.
OWN_MEANING = {("evaluate", "--data"): "the test data of a trained model",
               ("evaluate", "--model"): "the model of --weights (the registry's names listed)",
               ("predict", "--model"): "a run's own model named again (a directory imports none)",
               ("export", "--model"): "a run's own model named again (a directory imports none)",
               ("export", "--out"): "the ONNX file to write, not a run directory",
               ("demo", "--epochs"): "the demo's own length (3 epochs)",
               ("demo", "--download"): "CIFAR-10 only; without it the demo makes no connection",
               ("synth", "--seed"): "the seed of the synthetic images, not of a run"}


def test_an_option_named_like_a_config_field_is_that_fields_option():
    """Written once: wherever a command takes a config field's flag, the option is generated
    from the field (its help, type and default), unless ``OWN_MEANING`` says why not."""
    by_flag = {o.flag: o for o in options.options()}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    written_again = [f"{name} {flag}" for name, p in sub.choices.items() for a in p._actions
                     for flag in a.option_strings if flag in by_flag
                     and (name, flag) not in OWN_MEANING and a.dest != by_flag[flag].dest]
    assert written_again == []

