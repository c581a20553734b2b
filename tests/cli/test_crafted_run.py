"""A crafted run directory: config.json and every checkpoint's meta.json (its checksum has no key,
so anyone can recompute it) name ``os:system`` with ``model.args`` {"command": "touch MARK"}.
Whatever the user does with it, following the refusals' own hints included, the command never
runs: exit 2, one line, and the recorded path is never echoed where the user did not type it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.core.errors import UsageError
from pipeline.outputs.checkpoint import meta_checksum
from tests.helpers import run_cli

TRAIN = ("train", "--data", "synthetic:120:40", "--epochs", "1", "--batch-size", "20",
         "--strategy", "ipm", "--replicas", "2", "--mix-every", "3", "--workers", "2",
         "--checkpoint-every", "1", "--no-progress")
HINT = "this run's model is your own code, which a run directory never imports"
DIFFERENT = "this run's model is a different one than the one you named"
NOT_A_FACTORY = "os:system is a built-in function, not a class or Python function returning"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli(*TRAIN, "--model", "small-cnn", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _craft(record: dict, mark: Path) -> None:
    record["model"].update(name="os:system", args=json.dumps({"command": f"touch {mark}"}))


@pytest.fixture
def crafted(finished, tmp_path) -> tuple[Path, Path]:
    """(the crafted run, the file its command would create)."""
    run, mark = Path(shutil.copytree(finished, tmp_path / "run")), tmp_path / "PWNED"
    config = json.loads((run / "config.json").read_text())
    _craft(config, mark)
    (run / "config.json").write_text(json.dumps(config))
    metas = list(run.glob("checkpoints/round-*/meta.json"))
    assert metas
    for path in metas:
        meta = json.loads(path.read_text())
        _craft(meta["config"], mark)
        meta["checksum"] = meta_checksum(meta)  # no key: "written by a different run" passes
        path.write_text(json.dumps(meta))
    return run, mark


CASES = [  # (the command, what follows the run, what the line says); the user typed the args
    (("evaluate", "--run"), (), HINT),
    (("evaluate", "--run"), ("--model", "os:system"), NOT_A_FACTORY),
    (("evaluate", "--run"), ("--model", "subprocess:run"), DIFFERENT),
    (("predict", "--run"), ("IMAGE",), HINT),
    (("predict", "--run"), ("--model", "os:system", "IMAGE"), NOT_A_FACTORY),
    (("predict", "--run"), ("--model", "subprocess:run", "IMAGE"), DIFFERENT),
    (("train", "--resume"), ("--epochs", "2"), HINT),
    (("train", "--resume"), ("--epochs", "2", "--model", "os:system"), NOT_A_FACTORY),
    (("train", "--resume"), ("--epochs", "2", "--model", "json:loads"), DIFFERENT),
    (("train", "--resume"), ("--epochs", "2", "--model", "small-cnn"), DIFFERENT),
]


@pytest.mark.parametrize("command, args, message", CASES,
                         ids=[" ".join(c[0] + c[1]) for c in CASES])
def test_the_recorded_command_never_runs(crafted, command, args, message):
    run, mark = crafted
    args = tuple(str(run / "curves.png") if a == "IMAGE" else a for a in args)
    proc = run_cli(*command, str(run), *args, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and message in err[0], proc.stderr[-3000:]
    assert ("os:system" in err[0]) == ("os:system" in args), err[0]
    assert not mark.exists()


def test_load_model_never_runs_it(crafted):
    from pipeline import load_model
    run, mark = crafted
    for model, message in ((None, HINT), ("os:system", NOT_A_FACTORY),
                           ("json:loads", DIFFERENT)):
        with pytest.raises(UsageError) as info:
            load_model(run, model=model)
        line = str(info.value)
        assert message in line and "\n" not in line, line
        assert ("os:system" in line) == (model == "os:system"), line
        assert not mark.exists()
