"""From a finished run to a prediction (issue 25, item 1): `python -m pipeline predict` and
`pipeline.predict` give top-k class names and probabilities of new images, read as the run's
evaluation read its split; every run records its data's kind, class names and splits.

Runs go through `pipeline.cli.parser.main` in process against the in-process cluster.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import pipeline
from pipeline.cli.parser import main
from tests.images import photo, write_split_folder

FOLDER_ARGS = ["--image-size", "16", "--model", "small-cnn", "--strategy", "single",
               "--batch-size", "8", "--epochs", "1", "--lr", "0.01", "--augment", "flip",
               "--no-progress"]


@pytest.fixture(scope="module")
def flowers_run(tmp_path_factory, request):
    """A finished run on an image folder whose classes are named like flowers."""
    import distributed
    tmp = tmp_path_factory.mktemp("predict")
    root = write_split_folder(tmp / "flowers", classes=2, train=8, val=4)
    for split in ("train", "val"):
        for c, name in enumerate(("daisy", "tulip")):
            (root / split / f"class_{c}").rename(root / split / name)
    out = tmp / "run"
    printed = io.StringIO()
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            contextlib.redirect_stdout(printed):
        code = main(["train", "--data", str(root), *FOLDER_ARGS, "--out", str(out),
                     "--scheduler", cluster.scheduler_address])
    assert code == 0
    request.module.SUMMARY = printed.getvalue()
    return root, out


def test_every_run_records_its_data_kind_class_names_and_splits(flowers_run):
    root, out = flowers_run
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["dataset"] == "image-folder"  # it said cifar10 before
    record = json.loads((out / "data.json").read_text())
    assert record["kind"] == "image-folder" and record["class_names"] == ["daisy", "tulip"]
    assert record["splits"] == {"train": "train", "eval": "val"}
    assert record["images"] == {"train": 16, "val": 8} and record["image_shape"] == [3, 16, 16]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_split"] == "val" and summary["dataset_kind"] == "image-folder"
    assert summary["class_names"] == ["daisy", "tulip"]
    # what the run prints and draws calls the split val, not test
    import tests.cli.test_predict as this
    assert " val_acc " in this.SUMMARY and "test_acc" not in this.SUMMARY, this.SUMMARY
    from pipeline.outputs.plots import curves_figure
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    fig = curves_figure(history, split="val")
    assert fig.axes[1].get_legend_handles_labels()[1] == ["train", "val"]


def test_predict_command_prints_top_k_names_and_probabilities(flowers_run, tmp_path, capsys):
    root, out = flowers_run
    rng = np.random.default_rng(5)
    photos = tmp_path / "new"
    photos.mkdir()
    for i, c in enumerate((0, 1, 0)):
        Image.fromarray(photo(c, rng, 80, 60)).save(photos / f"p{i}.jpg", quality=90)
    capsys.readouterr()
    assert main(["predict", "--run", str(out), "--top", "2", str(photos)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith(str(photos / "p0.jpg"))
    for line in lines:
        words = line.split()
        assert {words[1], words[3]} == {"daisy", "tulip"}
        assert float(words[2]) >= float(words[4]) and \
            float(words[2]) + float(words[4]) == pytest.approx(1, abs=2e-3)
    assert main(["predict", "--run", str(out), "--format", "json", "--top", "1",
                 str(photos / "p1.jpg")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["image"] == str(photos / "p1.jpg") and len(record["top"]) == 1
    assert record["top"][0]["class"] in ("daisy", "tulip") and 0.5 <= \
        record["top"][0]["probability"] <= 1


def test_predict_reads_files_as_evaluation_reads_the_val_split(flowers_run):
    """The val images through pipeline.predict give the probabilities the evaluate- path does
    on the decoded val split (same crop, same size), and the names of the run."""
    from pipeline.data.datasets import load_dataset
    from pipeline.training import tasks
    from pipeline.training.evaluate import read_weights
    from pipeline.core.config import Config
    root, out = flowers_run
    result = pipeline.predict(str(out), root / "val")
    assert result.class_names == ["daisy", "tulip"] and result.proba.shape == (8, 2)
    np.testing.assert_allclose(result.proba.sum(axis=1), 1, atol=1e-5)
    cfg = Config().replace(**{"data.image_size": 16}).data
    ds = load_dataset(str(root), cfg)
    params = read_weights("small-cnn", str(out / "model.npz"), 2)
    expected = tasks.predict_proba(params, ds.test_images.compute(),
                                   tasks.EvalSpec("small-cnn", 2))
    np.testing.assert_allclose(result.proba, expected, rtol=1e-5, atol=1e-6)


def test_predict_takes_arrays_and_a_train_result(tmp_path, dask_client):
    from pipeline import Config
    cfg = Config().replace(**{"data.source": "synthetic:64:16", "train.strategy": "single",
                              "train.replicas": 1, "train.batch_size": 16, "train.epochs": 0.5,
                              "augment.policy": "flip", "out": str(tmp_path / "run"),
                              "progress": False})
    result = pipeline.train(cfg, dask_client, log=lambda m: None)
    images = np.zeros((2, 3, 32, 32), np.uint8)
    by_result = pipeline.predict(result, images)
    by_dir = pipeline.predict(tmp_path / "run", images)
    assert by_result.class_names[:2] == ["airplane", "automobile"] and by_result.proba.shape == \
        (2, 10)
    np.testing.assert_array_equal(by_result.proba, by_dir.proba)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["dataset"] == \
        "synthetic"
    with pytest.raises(ValueError, match=r"\(N, 3, 32, 32\) uint8"):
        pipeline.predict(result, np.zeros((1, 3, 16, 16), np.uint8))


def test_predict_refuses_bad_input_in_one_line(flowers_run, tmp_path, capsys):
    root, out = flowers_run
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.jpg").write_text("not a picture")
    cases = [([str(tmp_path / "missing.jpg")], "no such file"),
             ([str(tmp_path / "empty")], "no image files"),
             ([str(tmp_path / "notes.jpg")], "notes.jpg")]
    for images, words in cases:
        capsys.readouterr()
        assert main(["predict", "--run", str(out), *images]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert main(["predict", "--run", str(tmp_path), str(root)]) == 2
    assert "config.json" in capsys.readouterr().err
