"""The train and evaluate commands end to end, in process, on an embedded LocalCluster."""
import json

import pytest

from pipeline.cli.parser import main


@pytest.mark.slow
def test_train_then_evaluate(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--data", "synthetic:256:64", "--model", "small-cnn", "--strategy", "ipm",
               "--replicas", "2", "--mix-every", "4", "--epochs", "1", "--batch-size", "16",
               "--augment", "flip", "--workers", "1", "--threads-per-worker", "1", "--seed", "1",
               "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = captured.out.strip().splitlines()[-1]
    assert summary.startswith("done: 2 rounds") and "test_acc" in summary and "model.npz" in summary
    assert "dashboard http://127.0.0.1:" in captured.err  # the embedded cluster's link
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    rc = main(["evaluate", "--model", "small-cnn", "--weights", str(out / "model.npz"),
               "--data", "synthetic:256:64"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["n"] == 64
    assert result["test_acc"] == pytest.approx(last["test_acc"])

    rc = main(["evaluate", "--model", "small-cnn", "--weights", str(out / "model.npz"),
               "--data", "synthetic:256:64", "--tta"])
    assert rc == 0 and 0 <= json.loads(capsys.readouterr().out)["test_acc"] <= 1


def test_evaluate_with_weights_of_another_model_is_one_line(tmp_path, capsys):
    from pipeline.backends.chainer.compat import serializers
    from pipeline.backends.chainer.models import build_model
    path = tmp_path / "m.npz"
    serializers.save_npz(str(path), build_model("small-cnn"))
    rc = main(["evaluate", "--model", "resnet20", "--weights", str(path), "--data",
               "synthetic:64:32"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "do not fit model resnet20" in err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for name in ("synth", "inspect", "fetch", "train", "evaluate", "demo"):
        assert name in text
