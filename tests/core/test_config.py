"""Config sections: every field carries its description, validation names the field, the config
round-trips through JSON and pickle."""
import dataclasses
import json
import pickle
import re

import pytest

from pipeline.core.config import Config

BAD = [
    ({"train.replicas": 0}, "train.replicas"),
    ({"average.mix_every": "0"}, "average.mix_every"),
    ({"average.mix_every": "often"}, "average.mix_every"),
    ({"train.strategy": "Hog wild!"}, "train.strategy"),  # a name the registry checks: below
    ({"train.lr": -1.0}, "train.lr"),
    ({"train.optimizer": "rmsprop"}, "train.optimizer"),
    ({"train.device": "tpu"}, "train.device"),
    ({"model.cpu_kernels": "mkl"}, "model.cpu_kernels"),
    ({"train.epochs": 0}, "train.epochs"),
    ({"average.fan_in": 1}, "average.fan_in"),
    ({"average.outer_momentum": 1.0}, "average.outer_momentum"),
    ({"average.optimizer_state": "merge"}, "average.optimizer_state"),
    ({"cluster.tls_cert": "c.pem"}, "cluster.tls"),
    ({"train.strategy": "single", "train.replicas": 2}, "train.replicas"),
]


@pytest.mark.parametrize("changes, field", BAD)
def test_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Config().replace(**changes).validate()


def test_round_trips():
    cfg = Config().replace(**{"train.replicas": 3, "average.mix_every": "1ep", "seed": 7})
    assert Config.from_dict(json.loads(cfg.to_json())) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_mix_every_in_steps_or_epochs():
    cfg = Config()
    assert cfg.replace(**{"average.mix_every": "10"}).average.period(19) == 10
    assert cfg.replace(**{"average.mix_every": "2ep"}).average.period(19) == 38


def _fields(cls=Config, prefix=""):
    """(dotted name, field) of every setting of a config, sections opened."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            yield from _fields(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def test_every_field_carries_its_description():
    for name, f in _fields():
        assert f.metadata.get("help"), name
        flag = f.metadata["flag"]
        assert flag is None or re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", flag), name


@pytest.mark.parametrize("name, f", [(n, f) for n, f in _fields() if f.metadata["choices"]])
def test_declared_choices_are_what_validation_accepts(name, f):
    for value in f.metadata["choices"]:
        Config().replace(**{name: value}).validate()
    if name == "data.dataset":  # also what a run recorded: the readers' kinds, refused by them
        return  # (tests/training/test_round_trip.py::test_the_kinds_are_the_readers_own)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Config().replace(**{name: "bogus"}).validate()


@pytest.mark.parametrize("changes, message", [
    ({"cluster.adapt": "3:1"}, "cluster.adapt must be MIN:MAX with 1 <= MIN <= MAX <= 1024"),
    ({"cluster.adapt": "0:2"}, "cluster.adapt must be MIN:MAX"),
    ({"cluster.adapt": "1:2", "cluster.workers": 2}, "give it without cluster.workers"),
    ({"cluster.adapt": "1:2", "cluster.scheduler": "tcp://h:1"},
     "give it without cluster.scheduler"),
])
def test_adapt_is_min_colon_max_on_a_local_cluster(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config().replace(**changes).validate()
    Config().replace(**{"cluster.adapt": "1:3"}).validate()
