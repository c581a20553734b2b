"""Which callables may be a model factory, checked before anything calls them: a chainer.Link
subclass or a plain Python function outside the standard library. A run directory's model.args
would otherwise be the arguments of os:system or subprocess:run (docs/reliability.md)."""
from __future__ import annotations

import functools
import os
import sys
import textwrap

import pytest

from pipeline.backends import ModelRef, get_backend
from pipeline.backends import user as user_code
from pipeline.core.errors import UsageError

MODULE = textwrap.dedent('''
    import chainer
    import chainer.links as L


    class Net(chainer.Chain):
        def __init__(self, n_classes=10):
            super().__init__()
            with self.init_scope():
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            return self.fc(x)


    def make(n_classes=10):
        return Net(n_classes)


    class Maker:
        def __call__(self, n_classes=10):
            return Net(n_classes)


    maker = Maker()
    NotALink = Maker
''')


@pytest.fixture
def factories(tmp_path):
    """``myfactories`` in a directory outside the repository, on sys.path for the test."""
    (tmp_path / "myfactories.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("myfactories", None)


def _resolve(path: str, args: str = "{}", factory=None):
    return get_backend().resolve_model(path, args, path if factory is None else factory,
                                       (8, 8), 3)


@pytest.mark.parametrize("path, why", [
    ("os:system", "os:system is a built-in function"),
    ("builtins:eval", "builtins:eval is a built-in function"),
    ("json:loads", "json:loads is a function of the standard library (json)"),
    ("subprocess:run", "subprocess:run is a function of the standard library (subprocess)"),
    ("shutil:rmtree", "shutil:rmtree is a function of the standard library (shutil)"),
    ("subprocess:Popen", "subprocess:Popen is a class that is not a chainer.Link"),
    ("myfactories:maker", "myfactories:maker is a callable Maker instance"),
    ("myfactories:NotALink", "myfactories:NotALink is a class that is not a chainer.Link"),
    ("myfactories:maker.__call__", "myfactories:maker.__call__ is a method"),
    ("myfactories:maker.__str__", "myfactories:maker.__str__ is a method-wrapper"),
])
def test_what_cannot_be_a_factory_is_refused_before_it_is_called(factories, tmp_path, path,
                                                                   why):
    mark = tmp_path / "called"
    with pytest.raises(UsageError) as info:
        _resolve(path, f'{{"command": "touch {mark}", "args": ["touch", "{mark}"]}}')
    line = str(info.value)
    assert line.startswith(why) and "\n" not in line, line
    assert line.endswith("not a class or Python function returning a chainer.Link"), line
    assert not mark.exists()


@pytest.mark.parametrize("factory", [os.system, functools.partial(os.system, "true"),
                                     print, 42])
def test_callables_from_python_are_refused_too(tmp_path, factory):
    with pytest.raises(UsageError, match="not a class or Python function returning"):
        _resolve("mine:model", "{}", factory)


@pytest.mark.parametrize("path", ["myfactories:Net", "myfactories:make"])
def test_the_users_class_and_function_still_work(factories, path):
    ref = _resolve(path)
    assert isinstance(ref, ModelRef) and ref.path == path
    assert get_backend().init_params(ref, 3, 0)["fc/W"].shape == (3, 192)


def test_a_partial_of_the_users_function_and_the_zoo_pass(factories):
    import myfactories
    assert user_code.unfit(functools.partial(myfactories.make, n_classes=3)) is None
    from pipeline.backends.chainer.user_models import ZooNet, make_ref
    assert user_code.unfit(functools.partial(ZooNet, "resnet50")) is None
    assert make_ref("resnet50", "{}", None, (32, 32)).path == "resnet50"


def test_recorded_arguments_reach_only_the_model_they_were_recorded_with():
    user_code.paired("nets:Net", "nets:Net")
    user_code.paired("small-cnn", "resnet20")  # registry models take no arguments
    for recorded, named in (("os:system", "nets:Net"), ("small-cnn", "nets:Net"),
                            ("nets:Net", "small-cnn")):
        with pytest.raises(UsageError, match="a different one than the one you named") as info:
            user_code.paired(recorded, named)
        assert recorded not in str(info.value) and named in str(info.value)


def test_the_hint_to_name_the_model_again_echoes_no_recorded_path():
    with pytest.raises(UsageError) as info:  # a recorded path, no factory named
        get_backend().resolve_model("os:system", "{}", None, (8, 8), 3)
    assert "os:system" not in str(info.value)
    assert "--model pkg.module:factory" in str(info.value)
