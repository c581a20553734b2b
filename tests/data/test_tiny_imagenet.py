"""Data as people have it: a Tiny-ImageNet-shaped folder (boxes files, .DS_Store, a val split as
a tab-separated list of class names) inspected and trained on as it ships; file lists labelled
by class names."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.cli.parser import main
from pipeline.core.config import DataConfig
from pipeline.core.errors import DataError
from pipeline.data import datasets as data
from pipeline.data import imagefolder
from pipeline.training.loop import train
from tests.helpers import assert_train_refused, make_config
from tests.images import write_folder, write_tiny_imagenet


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_imagenet(tmp_path_factory.mktemp("t") / "tiny-imagenet-200")


def _val(tiny, **fields) -> DataConfig:
    return DataConfig(val_source=str(tiny / "val" / "val_annotations.txt"),
                      image_root=str(tiny / "val" / "images"), image_size=32, **fields)


def test_inspect_skips_boxes_and_hidden_files_and_counts_them(tiny):
    info = data.inspect_dataset(str(tiny / "train"), cfg=_val(tiny))
    assert (info["train"], info["test"], info["classes"]) == (18, 6, 3)
    assert info["label_names"] == sorted(info["label_names"])
    assert info["skipped"]["train"] == {".txt": 3, "hidden file": 4, "hidden folder": 1}  # in the classes
    assert info["skipped"]["val"] == {}
    assert info["class_counts"]["val"] == {w: 2 for w in info["label_names"]}
    assert info["formats"] == {"JPEG": 24}


def test_the_root_as_it_ships_finds_train_and_the_annotated_val(tiny):
    info = data.inspect_dataset(str(tiny), cfg=DataConfig(image_size=32))
    assert (info["train"], info["test"], info["classes"]) == (18, 6, 3)
    assert info["class_counts"]["val"] == {w: 2 for w in info["label_names"]}


def test_val_annotations_map_class_names_to_the_train_indices(tiny):
    ds = data.load_dataset(str(tiny / "train"), _val(tiny))
    _, _, _, ty = data.dataset_arrays(ds)
    names = ds.label_names
    lines = (tiny / "val" / "val_annotations.txt").read_text().splitlines()
    assert [names[i] for i in ty] == [line.split("\t")[1] for line in lines]


def test_cli_inspect_prints_the_skipped_counts(tiny, capsys):
    code = main(["inspect", "--data", str(tiny / "train"), "--val-data",
                 str(tiny / "val" / "val_annotations.txt"), "--image-root",
                 str(tiny / "val" / "images")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out)["skipped"]["train"][".txt"] == 3


def test_an_undecodable_file_named_as_an_image_is_still_refused(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=3)
    (root / "class_1" / "notes.txt").write_text("skipped")
    (root / "class_1" / "broken.JPEG").write_text("not a JPEG")
    with pytest.raises(DataError, match=r"broken.JPEG: not an image Pillow can read") as err:
        data.inspect_dataset(str(root))
    assert "\n" not in str(err.value)


def test_class_name_lists(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=4)
    lines = [f"class_{c}/img_{i:03d}.jpg\tclass_{c}\textra 1\t2" for c in (1, 0) for i in range(4)]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    listing = imagefolder.read_file_list(str(tmp_path / "train.tsv"), str(root))
    assert listing.class_names == ("class_0", "class_1")  # sorted, as torchvision's
    assert [f.label for f in listing.files] == [1] * 4 + [0] * 4
    spaced = tmp_path / "val.txt"  # space separated, extra columns after an existing path
    spaced.write_text("class_0/img_000.jpg class_1 10 20 30 40\n")
    val = imagefolder.read_file_list(str(spaced), str(root), class_names=("class_0", "class_1"))
    assert [f.label for f in val.files] == [1]
    spaced.write_text("class_0/img_000.jpg n99\n")
    with pytest.raises(DataError, match=r"val.txt:1: class 'n99' is not one of the training "
                                        r"classes \(class_0, class_1\)"):
        imagefolder.read_file_list(str(spaced), str(root), class_names=("class_0", "class_1"))
    spaced.write_text("class_0/img_000.jpg 0\nclass_0/img_001.jpg class_1\n")
    with pytest.raises(DataError, match="numbers or names, not both"):
        imagefolder.read_file_list(str(spaced), str(root))


def test_unknown_val_class_name_is_one_line_and_exit_2(tiny, tmp_path, capsys,
                                                       scheduler):
    bad = tmp_path / "val_annotations.txt"
    bad.write_text((tiny / "val" / "val_annotations.txt").read_text() + "val_0.JPEG\tn0999\n")
    line = assert_train_refused(capsys, "--data", str(tiny / "train"), "--val-data", str(bad),
                                "--image-root", str(tiny / "val" / "images"), "--image-size",
                                "16", "--strategy", "single", "--no-progress", "--scheduler",
                                scheduler, out=tmp_path / "out")
    assert "val_annotations.txt:7: class 'n0999' is not one of the training classes" in line


def test_trains_on_the_folder_as_it_ships(tiny, dask_client):
    config = make_config({"data.source": str(tiny / "train"),
                          "data.val_source": str(tiny / "val" / "val_annotations.txt"),
                          "data.image_root": str(tiny / "val" / "images"),
                          "data.image_size": 32, "model.name": "small-cnn",
                          "train.strategy": "single", "train.replicas": 1, "train.batch_size": 6,
                          "train.epochs": 1.0, "progress": False})
    result = train(config, dask_client, log=lambda m: None)
    assert result.history and result.model.fc.W.shape[0] == 3
    assert np.isfinite(result.history[-1]["train_loss"])


def test_numbered_classes_sort_as_numbers_and_val_lines_name_them(tmp_path):
    """Folders 0..10 sorted as strings (0, 1, 10, 2, ...), and a val line naming class 2 was read
    as index 2 (the class named "10"): numbered classes are in numeric order and a val list
    whose labels all name training classes is read by name."""
    root = write_tiny_imagenet(tmp_path / "numbered", classes=11, train=1, val=1)
    wnids = sorted(p.name for p in (root / "train").iterdir() if p.name.startswith("n0"))
    annotations = (root / "val" / "val_annotations.txt").read_text()
    for c, wnid in enumerate(wnids):
        (root / "train" / wnid).rename(root / "train" / str(c))
        annotations = annotations.replace(wnid, str(c))
    (root / "val" / "val_annotations.txt").write_text(annotations)
    train, val = imagefolder.folder_splits(str(root))
    assert train.class_names == tuple(str(c) for c in range(11))
    assert [f.label for f in train.files] == list(range(11))
    named = [line.split("\t")[1] for line in annotations.splitlines()]
    assert [val.class_names[f.label] for f in val.files] == named
    # the same by name where names and indices differ: classes 3..13
    for c in reversed(range(11)):
        (root / "train" / str(c)).rename(root / "train" / str(c + 3))
    relabelled = "".join(f"{line.split(chr(9))[0]}\t{int(line.split(chr(9))[1]) + 3}\n"
                         for line in annotations.splitlines())
    (root / "val" / "val_annotations.txt").write_text(relabelled)
    train, val = imagefolder.folder_splits(str(root))
    assert train.class_names == tuple(str(c) for c in range(3, 14))
    assert [val.class_names[f.label] for f in val.files] == [str(int(n) + 3) for n in named]


def test_a_nul_byte_in_a_file_list_names_the_list_and_line(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=2)
    lst = tmp_path / "train.txt"
    lst.write_text("class_0/img_000.jpg 0\nclass_0/img\0_001.jpg 0\nclass_1/img_000.jpg 1\n")
    with pytest.raises(DataError) as err:
        imagefolder.read_file_list(str(lst), str(root))
    assert str(err.value) == f"{lst}:2: a NUL byte in 'class_0/img\\x00_001.jpg 0'; no path " \
        "or class name holds one"


def test_a_class_name_past_the_readers_limit_is_one_line(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=2)
    lst = tmp_path / "train.txt"
    long = "c" * 300
    lst.write_text(f"class_0/img_000.jpg a\nclass_0/img_001.jpg a\nclass_1/img_000.jpg {long}\n"
                   f"class_1/img_001.jpg {long}\n")
    with pytest.raises(DataError, match=f"{lst}: class 1's name is 300 characters "
                       r"\('cccc.*'\); at most 255"):
        data.inspect_dataset(str(lst), cfg=DataConfig(image_root=str(root), image_size=16))
