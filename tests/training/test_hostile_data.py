"""Hostile and unlucky image data, round three, through the train command: labels bounded before
anything is sized by them, list lines split only at newlines, names of any bytes, deep folders,
and an --out inside the data."""
from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.parser import main
from pipeline.core.errors import DataError, UsageError
from pipeline.data import imagefolder
from pipeline.outputs import fs
from tests.images import write_folder
from tests.helpers import assert_train_refused

ARGS = ["--image-size", "16", "--model", "small-cnn", "--strategy", "single", "--batch-size", "4",
        "--epochs", "0.5", "--no-progress"]
LIST = "".join(f"class_{c}/img_{i:03d}.jpg {c}\n" for c in range(2) for i in range(8))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("good"), classes=2, per_class=8)


@pytest.mark.parametrize("label, expected", [
    ("30000000", "train.txt:17: label 30000000 is out of range: the list names 17 images, so "
                 "with every class present labels are at most 16"),
    ("1" * 18, f"train.txt:17: label {'1' * 18} is out of range: the list names 17 images"),
    ("1" * 19, "train.txt:17: expected 'path label' with an integer label"),
    ("\u00b2", "train.txt:17: expected 'path label' with an integer label, got "
               "'class_0/img_000.jpg \u00b2'"),
    ("+-1", "train.txt:17: expected 'path label' with an integer label"),
])
def test_a_label_is_bounded_before_anything_is_sized_by_it(good, tmp_path, capsys, scheduler,
                                                           label, expected):
    lst = tmp_path / "train.txt"
    lst.write_text(LIST + f"class_0/img_000.jpg {label}\n")
    tracemalloc.start()
    try:
        line = assert_train_refused(capsys, "--data", str(lst), "--image-root", str(good),
                                    *ARGS, "--scheduler", scheduler, out=tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert expected in line, line
    assert peak < 64 << 20, peak


def test_list_paths_keep_vt_ff_cr_and_line_separators(good, tmp_path, dask_client):
    """Characters ``str.splitlines`` breaks at are path characters; a list with CRLF endings
    still reads."""
    root = Path(shutil.copytree(good, tmp_path / "data"))
    names = ["a\x0bb.jpg", "c\x0cd.jpg", "e\rf.jpg", "g\u2028h.jpg", "i\x1cj.jpg"]
    lines = []
    for i, name in enumerate(names):
        os.rename(root / f"class_{i % 2}" / f"img_00{i}.jpg", root / f"class_{i % 2}" / name)
        lines.append(f"class_{i % 2}/{name} {i % 2}")
    lines += [f"class_{c}/img_{i:03d}.jpg {c}" for c in range(2) for i in range(5, 8)]
    lst = tmp_path / "train.txt"
    lst.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    listing = imagefolder.read_file_list(str(lst), str(root))
    assert {os.path.basename(f.path) for f in listing.files} >= set(names)
    assert len(listing.files) == len(lines)


def _nested(root: Path, depth: int) -> Path:
    """``root/a/a/.../a`` ``depth`` deep, made relative to stay under PATH_MAX per call."""
    here = os.open(root, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=here)
            nxt = os.open("a", os.O_RDONLY, dir_fd=here)
            os.close(here)
            here = nxt
    finally:
        os.close(here)
    return root


def _remove_nested(folder: Path) -> None:
    """Undo :func:`_nested` without recursion (``shutil.rmtree`` of Python 3.11 recurses, and
    pytest's clean-up of old temporary directories would overflow on it)."""
    fds = [os.open(folder, os.O_RDONLY)]  # noqa: SIM115
    while True:
        try:
            fds.append(os.open("a", os.O_RDONLY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    os.close(fds.pop())  # the deepest: nothing below it
    while fds:
        os.rmdir("a", dir_fd=fds[-1])
        os.close(fds.pop())


def test_a_class_folder_nested_1200_deep_is_listed(good, tmp_path):
    root = Path(shutil.copytree(good, tmp_path / "data"))
    try:
        _nested(root / "class_0", 1200)
        listing = imagefolder.list_folder(str(root))
    finally:
        _remove_nested(root / "class_0")
    assert len(listing.files) == 16


def test_a_name_of_non_utf8_bytes_trains(good, tmp_path, dask_client):
    root = Path(shutil.copytree(good, tmp_path / "data"))
    os.rename(root / "class_0" / "img_000.jpg", os.fsencode(root / "class_0") + b"/caf\xe9.jpg")
    listing = imagefolder.list_folder(str(root))
    assert len(imagefolder.fingerprint(listing.files)) == 40
    out = tmp_path / "out"
    assert main(["train", "--data", str(root), *ARGS, "--scheduler",
                 dask_client.scheduler.address, "--out", str(out)]) == 0
    assert (out / "model.npz").is_file()


def test_an_out_inside_the_image_folder_is_not_read_as_a_class(good, tmp_path, dask_client,
                                                              capsys):
    assert imagefolder.RUN_MARKER == fs.MARKER
    root = Path(shutil.copytree(good, tmp_path / "data"))
    out = root / "run"
    args = ["--data", str(root), *ARGS[:-3], "--checkpoint-every", "1", "--no-progress",
            "--scheduler", dask_client.scheduler.address]
    assert main(["train", *args, "--epochs", "0.5", "--out", str(out)]) == 0
    assert main(["train", "--resume", str(out), "--epochs", "1", "--scheduler",
                 dask_client.scheduler.address]) == 0, capsys.readouterr().err


def test_a_task_out_of_memory_names_the_options_that_size_it(tmp_path, capsys, scheduler,
                                                             monkeypatch):
    """What --image-size 1024 on resnet20 did on a small worker: MemoryError inside the train
    task. Now one line naming --image-size and --batch-size, exit 2, no traceback."""
    from pipeline.backends.chainer.backend import ChainerBackend

    def no_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(ChainerBackend, "train_steps", no_memory)
    assert main(["train", "--data", "synthetic:64:16", "--model", "small-cnn", "--strategy",
                 "single", "--batch-size", "8", "--epochs", "0.5", "--no-progress",
                 "--scheduler", scheduler, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "MemoryError" not in err, err
    assert err.strip().splitlines()[-1] == (
        "error: out of memory in a task of small-cnn on 32x32 images, batch 8: lower "
        "--image-size or --batch-size (or give the workers more memory)"), err


def test_a_worker_result_of_the_wrong_form_is_one_line_naming_the_worker(tmp_path, capsys,
                                                                        scheduler, monkeypatch):
    """A worker of another version (or a hostile one) returning metrics the driver cannot use:
    one line naming the worker and what it returned, never a KeyError."""
    from pipeline.backends.chainer.backend import ChainerBackend
    real = ChainerBackend.train_steps

    def other_version(self, *args, **kwargs):
        params, opt, stats = real(self, *args, **kwargs)
        return params, opt, stats._replace(n=str(stats.n))
    monkeypatch.setattr(ChainerBackend, "train_steps", other_version)
    assert main(["train", "--data", "synthetic:64:16", "--model", "small-cnn", "--strategy",
                 "single", "--batch-size", "8", "--epochs", "0.5", "--no-progress",
                 "--scheduler", scheduler, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "KeyError" not in err, err
    assert last.startswith("error: worker inproc://") and " returned 'n' of type str (expected " \
        "int) for train task " in last, last


# --------------------------------------------------------------------------------------------
# data.json as predict reads it back: bounded by what the run justifies


@pytest.fixture(scope="module")
def run(good, tmp_path_factory, dask_client) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert main(["train", "--data", str(good), *ARGS, "--out", str(out), "--scheduler",
                 dask_client.scheduler.address]) == 0
    return out


def _edited(run: Path, tmp_path: Path, **fields) -> Path:
    """A copy of ``run`` whose data.json has ``fields`` replaced."""
    out = Path(shutil.copytree(run, tmp_path / "edited"))
    record = json.loads((out / "data.json").read_text())
    (out / "data.json").write_text(json.dumps({**record, **fields}, indent=1))
    return out


@pytest.mark.parametrize("shape, expected", [
    ([3, 27000, 27000], "data.json: image_shape [3, 27000, 27000] is not [3, S, S] with S in "
                        "1..1024 pixels"),
    ([3, 16, 17], "is not [3, S, S]"), ([1, 16, 16], "is not [3, S, S]"),
    (["3", 16, 16], "is not [3, S, S]"), ([3, 16.0, 16.0], "is not [3, S, S]"),
    ([3, 32, 32], "data.json's image_shape [3, 32, 32] says the model saw 32x32 images; its "
                  "config says 16x16"),
])
def test_predict_bounds_the_recorded_image_shape_by_the_run(run, tmp_path, shape, expected):
    """A 4 KB edit of data.json made one 8x8 image cost 2.2 GB: the side predict resizes every
    image to is the run's, at most 1024."""
    from pipeline.training import predict
    with pytest.raises(DataError) as err:
        predict.load(_edited(run, tmp_path, image_shape=shape))
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert predict.load(run).side == 16


def test_predict_reads_the_class_names_any_run_writes(run, tmp_path):
    """100,000 classes of 12-character names: a data.json of 2 MB that predict refused (its cap
    was config.json's 1 MiB); names past the readers' limits are refused as readers refuse them."""
    from pipeline.training import predict
    names = [f"class_{i:06d}" for i in range(100_000)]
    record = predict._data_record(_edited(run, tmp_path, class_names=names, n_classes=len(names)))
    assert record["class_names"] == names
    long = _edited(run, tmp_path / "long", class_names=["a", "b" * 300], n_classes=2)
    with pytest.raises(DataError, match="data.json: class 1's name is 300 characters"):
        predict.load(long)


_EDITS = st.fixed_dictionaries({}, optional={
    "image_shape": st.one_of(st.none(), st.integers(-1, 1 << 40), st.lists(
        st.one_of(st.integers(-2, 1 << 40), st.floats(), st.text(max_size=3)), max_size=5)),
    "class_names": st.one_of(st.lists(st.text(max_size=4), max_size=4), st.integers()),
    "n_classes": st.one_of(st.integers(-1, 1 << 40), st.floats(), st.none()),
    "kind": st.sampled_from(["image-folder", "arrays", "cifar10", "x", ""]),
    "source": st.one_of(st.text(max_size=8), st.integers())})


@given(edits=_EDITS)
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_data_json_edits_give_a_model_or_one_line(run, tmp_path_factory, edits):
    from pipeline.training import predict
    out = _edited(run, tmp_path_factory.mktemp("fuzz"), **edits)
    try:
        model = predict.load(out)
    except UsageError as err:  # DataError, or the names against the model's classes
        assert "\n" not in str(err), str(err)
        return
    assert model.side == 16 and len(model.class_names) == 2


def test_a_resume_refuses_classes_in_another_order(tmp_path, capsys, dask_client):
    """Class index i of the checkpoint is the class data.json names i: a folder whose classes
    now sort otherwise (numbered folders sorted as strings before) is refused, not trained on
    the wrong labels."""
    root = write_folder(tmp_path / "data", classes=2, per_class=8)
    (root / "class_0").rename(root / "b")
    (root / "class_1").rename(root / "a")
    out = tmp_path / "out"
    args = ["--data", str(root), *ARGS, "--scheduler", dask_client.scheduler.address]
    assert main(["train", *args, "--out", str(out)]) == 0
    (root / "a").rename(root / "c")  # classes b, c: index 0 is now b
    capsys.readouterr()
    line = assert_train_refused(capsys, "--resume", str(out), "--epochs", "1", "--scheduler",
                                dask_client.scheduler.address, "--no-progress")
    assert f"{out} was trained on 2 classes, class 0 named 'a'; the data now gives 2, class 0 " \
        "named 'b'" in line, line
