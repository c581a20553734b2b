"""The run configuration: frozen dataclasses in small sections, each field described once (its
metadata, ``pipeline.core.fields.opt``), validated with errors that name the field.

``Config`` holds the sections; they live by concern in ``config_data`` (data, augment, model),
``config_train`` (train, average, asynchronous) and ``config_cluster`` (cluster), and every name
of theirs is importable from here.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from pipeline.core.config_cluster import DAY_S, ClusterConfig, dashboard_port
from pipeline.core.config_data import (CACHE_MODES, CPU_KERNELS, DATASETS, LABEL_KINDS,
                                       KIND_FORM, AugmentConfig, DataConfig, ModelConfig)
from pipeline.core.config_train import (ASYNC_ORDERS, ASYNC_PUSHES, DEVICES, LR_DECAYS,
                                        LR_SCALINGS, MAX_EPOCHS, MAX_REPLICAS, NAME_FORM,
                                        OPT_STATE_MODES, OPTIMIZERS, STALENESS_SCALINGS,
                                        AsyncConfig, AverageConfig, TrainConfig)
from pipeline.core.fields import (WORDS, check, is_json_object, is_kind, is_tracking_uri, opt,
                                  short)

__all__ = ("Config", "DataConfig", "AugmentConfig", "ModelConfig", "TrainConfig",
           "AverageConfig", "AsyncConfig", "ClusterConfig", "OPTIMIZERS", "DEVICES",
           "OPT_STATE_MODES", "LR_SCALINGS", "LR_DECAYS", "CPU_KERNELS", "NAME_FORM",
           "CACHE_MODES", "DATASETS", "KIND_FORM", "LABEL_KINDS", "ASYNC_ORDERS",
           "ASYNC_PUSHES", "STALENESS_SCALINGS", "MAX_EPOCHS", "MAX_REPLICAS", "DAY_S",
           "dashboard_port", "is_json_object", "opt")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = opt(0, "run seed: every random stream derives from it (pipeline.core.rng)",
                    flag="--seed", metavar="N")
    out: str | None = opt(None, "output directory (metrics.jsonl, model.npz, curves.png, "
                          "checkpoints/)", none="no outputs")
    eval_every: int = opt(0, "evaluate on the test set every N rounds as well as at each epoch's "
                          "end (0: epoch ends only)", flag="--eval-every", metavar="N",
                          unit="rounds")
    checkpoint_every: int = opt(10, "write a checkpoint every N rounds and at the end (0: at the "
                                "end only)", flag="--checkpoint-every", metavar="N",
                                unit="rounds")
    # Distributed keeps a released task's record while a task computed from it on that worker is
    # alive: an unbroken chain of rounds grows a worker ~40 KiB a round.
    anchor_every: int = opt(100, "at most N rounds between anchors: where checkpoints are further "
                            "apart (or off, or there is no output directory) the state is also "
                            "gathered every N rounds, unwritten, and the run goes on from it as "
                            "a fresh root, which bounds what a lost worker replays and what the "
                            "workers keep (0: at checkpoints only)", flag="--anchor-every",
                            metavar="N", unit="rounds")
    progress: bool = opt(True, "show a progress bar on stderr", flag="--progress")
    tensorboard: bool = opt(False, "also write TensorBoard event files to OUT/tensorboard/",
                            flag="--tensorboard")
    csv: bool = opt(False, "also write the metrics as OUT/metrics.csv (one row per round)",
                    flag="--csv")
    mlflow: str | None = opt(None, "also log the run to the MLflow tracking server at this "
                             "http(s):// URI: the config as parameters, each round's metrics "
                             "and stage seconds, model.npz, curves.png and config.json as "
                             "artifacts; OUT/mlflow.json keeps the MLflow run id, so --resume "
                             "goes on in the same MLflow run. A server that is down or refuses "
                             "costs one warning line, never the run (the [mlflow] extra)",
                             flag="--mlflow", metavar="URI", none="off")

    def validate(self) -> "Config":
        for name in _SECTIONS:
            check(isinstance(getattr(self, name), _SECTIONS[name]), name,
                   "must be a section (a JSON object)", getattr(self, name))
        for name in _SECTIONS:
            getattr(self, name).validate()
        for f in dataclasses.fields(self):
            if f.name not in _SECTIONS:
                kinds = [k.strip() for k in str(f.type).split("|")]
                check(any(is_kind(getattr(self, f.name), k) for k in kinds), f.name,
                       f"must be {' or '.join(WORDS[k] for k in kinds)}", getattr(self, f.name))
        check(self.seed >= 0, "seed", "must be >= 0", self.seed)
        check(self.out is None or self.out != "", "out",
               "must be a directory path (or None for no outputs)", self.out)
        check(self.eval_every >= 0, "eval_every", "must be >= 0", self.eval_every)
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0",
               self.checkpoint_every)
        check(self.anchor_every >= 0, "anchor_every", "must be >= 0", self.anchor_every)
        check(self.mlflow is None or is_tracking_uri(self.mlflow), "mlflow",
              "must be an http:// or https:// tracking server URI (or None)", self.mlflow)
        if self.mlflow is not None and "@" in self.mlflow.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError("mlflow must not carry a user name or password (config.json keeps "
                             "the URI): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                             "(or MLFLOW_TRACKING_TOKEN) instead")  # the value is not echoed
        return self

    def replace(self, **sections) -> "Config":
        """Copy with some fields replaced; dotted names reach into sections.

        >>> Config().replace(**{"train.replicas": 2, "seed": 3}).train.replicas
        2
        """
        top, nested = {}, {}
        for name, value in sections.items():
            if "." in name:
                section, key = name.split(".", 1)
                nested.setdefault(section, {})[key] = value
            else:
                top[name] = value
        for section, values in nested.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A config from its ``to_dict`` form (config.json); ValueError naming the first field
        that is unknown, missing its section or of the wrong type. Validated."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in d.items():
            if name not in names:
                raise ValueError(f"config has unknown field {str(name)[:60]!r}")
            if name in _SECTIONS:
                if not isinstance(value, dict):
                    raise ValueError(f"{name} must be a section (a JSON object), got "
                                     f"{short(value)}")
                known = {f.name for f in dataclasses.fields(_SECTIONS[name])}
                unknown = [k for k in value if k not in known]
                if unknown:
                    raise ValueError(f"config has unknown field {name}.{str(unknown[0])[:60]}")
                kwargs[name] = _SECTIONS[name](**value)
            else:
                kwargs[name] = value
        return cls(**kwargs).validate()


_SECTIONS = {"data": DataConfig, "augment": AugmentConfig, "model": ModelConfig,
             "train": TrainConfig, "average": AverageConfig, "asynchronous": AsyncConfig,
             "cluster": ClusterConfig}
