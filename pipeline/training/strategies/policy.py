"""A strategy's config-time policy: what it refuses, the recipe that fills the settings left open,
and the plan of rounds a config gives; asked before any cluster exists (``prepare.normalise``,
``prepare.plan``), apart from the round builder (``base.Strategy``) that subclasses it.
"""
from __future__ import annotations

from pipeline.core.errors import UsageError
from pipeline.core.schedule import Round, continue_plan, steps_per_epoch


class Policy:
    """Class-level facts and decisions of a strategy; nothing here touches a cluster."""

    name = ""
    mix = "every"  # which rounds end in an average: every | last | never (schedule.plan_rounds)
    stages = ("load", "augment", "train", "average", "evaluate")  # stage_seconds it reports
    files = ()  # its own files in the output directory (removed by --overwrite)

    PLAIN = {"train.lr_scaling": "none", "train.warmup_epochs": 0.0, "train.beta1": 0.9,
             "train.beta2": 0.999, "train.adam_eps": 1e-8, "average.outer_lr": 1.0,
             "average.outer_warmup_epochs": 0.0, "average.optimizer_state": "keep",
             "average.adaptive_outer": False, "average.mix_every": "10"}

    @classmethod
    def recipe(cls, config) -> dict:
        """Values for the fields left at auto/None when ``train.recipe`` is on (none here)."""
        return {}

    @classmethod
    def resolve(cls, config):
        """``config`` with every auto/None field filled: from ``recipe`` when ``train.recipe``
        is on, else (and for fields the recipe leaves open) with the plain values."""
        chosen = {**cls.PLAIN, **(cls.recipe(config) if config.train.recipe else {})}
        open_fields = {}
        for name, value in chosen.items():
            section, field = name.split(".")
            if getattr(getattr(config, section), field) in (None, "auto"):
                open_fields[name] = value
        return config.replace(**open_fields) if open_fields else config

    @classmethod
    def check(cls, config) -> None:
        """UsageError for settings this strategy cannot run (beyond config.validate)."""
        if config.train.replicas < 1:
            raise UsageError("train.replicas must be >= 1")

    @classmethod
    def period_of(cls, config, per_epoch: int) -> int:
        """Local steps per round (an unresolved config's ``auto`` H is its recipe's)."""
        return cls.resolve(config).average.period(per_epoch)

    @classmethod
    def plan(cls, config, n_train: int, done: list = ()) -> tuple[list[Round], int, int]:
        """(rounds, steps per epoch, local steps per round) of ``config``, after the ``done``
        rounds of a resumed run (``schedule.continue_plan``)."""
        t = config.train
        per_epoch = steps_per_epoch(n_train, t.replicas, t.batch_size)
        period = cls.period_of(config, per_epoch)
        rounds = continue_plan(list(done), n_train, t.replicas, t.batch_size, t.epochs, period,
                               cls.mix)
        return rounds, per_epoch, period

    @classmethod
    def average_payload(cls, config, param_bytes: int) -> int:
        """Bytes per replica that one of its averages adds up (0: it never averages), which
        ``--average auto`` weighs to pick an algorithm."""
        return param_bytes if config.train.replicas > 1 else 0
