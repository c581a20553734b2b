"""Names from input data reach the terminal escaped (pipeline.core.text.printable): `predict`'s
table, the error line and the log lines of a run show a class or file name's escape sequences
(window title, clear screen, colours) as text and never send them."""
from __future__ import annotations

import json

import numpy as np

from pipeline.cli.parser import main
from pipeline.training import predict as predicting

TITLE, CLEAR, COLOUR = "\x1b]0;owned\x07", "\x1b[2J", "\x9b31m"  # the last: the 8-bit CSI


def _fake_predict(run, images, tta=False, model=None):
    return predicting.Prediction(np.array([[0.75, 0.25]], np.float32),
                                 [f"daisy{TITLE}", f"tulip{COLOUR}"], [f"img{CLEAR}.png"])


def test_predict_table_shows_class_names_and_paths_escaped(monkeypatch, capsys):
    monkeypatch.setattr(predicting, "predict", _fake_predict)
    assert main(["predict", "--run", "r", "img.png", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert out == r"img\x1b[2J.png  daisy\x1b]0;owned\x07 0.750  tulip\x9b31m 0.250" + "\n"


def test_predict_json_keeps_the_names_and_escapes_them_as_json_does(monkeypatch, capsys):
    monkeypatch.setattr(predicting, "predict", _fake_predict)
    assert main(["predict", "--run", "r", "img.png", "--top", "1", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x9b" not in out
    assert json.loads(out) == {"image": f"img{CLEAR}.png",
                               "top": [{"class": f"daisy{TITLE}", "probability": 0.75}]}


def test_the_error_line_shows_a_named_path_escaped(tmp_path, capsys):
    assert main(["inspect", "--data", str(tmp_path / f"no{TITLE}such{CLEAR}")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert r"no\x1b]0;owned\x07such\x1b[2J: no such file" in err


def test_a_runs_log_lines_show_names_escaped(capsys):
    from pipeline.training.loop import _log_default
    _log_default(f"skipped {CLEAR}cat.png")
    assert capsys.readouterr().err == r"skipped \x1b[2Jcat.png" + "\n"


def test_inspect_prints_class_names_as_json_escapes(tmp_path, capsys):
    from tests.images import write_folder
    root = write_folder(tmp_path / "flowers", classes=2, per_class=3)
    (root / "class_1").rename(root / f"tulip{TITLE}{COLOUR}")
    assert main(["inspect", "--data", str(root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert json.loads(out)["label_names"] == ["class_0", f"tulip{TITLE}{COLOUR}"]
