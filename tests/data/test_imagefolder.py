"""Image folders and file lists: listing, splits, modes to RGB, decoding, the scan- and decode- graph."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from PIL import Image

from pipeline.data import datasets as data
from pipeline.data import images as image_sources
from pipeline.data import imagefolder
from pipeline.core.config import DataConfig
from pipeline.core.errors import DataError
from tests.images import png16, write_folder, write_list, write_split_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x 10 JPEGs of mixed sizes, no train/val split."""
    return write_folder(tmp_path_factory.mktemp("folder"), classes=3, per_class=10)


def test_folder_lists_sorted_classes_and_splits_each_class(folder):
    cfg = DataConfig(image_size=32, val_fraction=0.2)
    info = data.inspect_dataset(str(folder), cfg=cfg)
    assert info["label_names"] == ["class_0", "class_1", "class_2"]
    assert (info["train"], info["test"], info["shape"]) == (24, 6, [3, 32, 32])
    assert info["class_counts"] == {"train": {f"class_{c}": 8 for c in range(3)},
                                    "val": {f"class_{c}": 2 for c in range(3)}}
    assert info["formats"] == {"JPEG": 30} and info["modes"] == {"RGB": 30}
    assert sum(info["sizes_seen"].values()) == 30 and info["width_range"] == [40, 90]


def test_split_is_seeded_by_the_data_seed_not_the_run(folder):
    plan = lambda seed: data._plan(str(folder), DataConfig(split_seed=seed), False)  # noqa: E731
    names = lambda p: [f.path for c in p.test for f in c.files]  # noqa: E731
    assert names(plan(0)) == names(plan(0)) and names(plan(0)) != names(plan(1))
    assert not set(names(plan(0))) & {f.path for c in plan(0).train for f in c.files}


def test_train_val_layout_and_val_split_images(tmp_path):
    root = write_split_folder(tmp_path / "tv", classes=2, train=6, val=3)
    ds = data.load_dataset(str(root), DataConfig(image_size=24))
    x, y, tx, ty = data.dataset_arrays(ds)
    assert x.shape == (12, 3, 24, 24) and tx.shape == (6, 3, 24, 24) and x.dtype == np.uint8
    assert y.tolist() == [0] * 6 + [1] * 6 and ty.tolist() == [0] * 3 + [1] * 3
    # the learnable signal survives decoding: class 0 is red, class 1 green
    assert (x[y == 0, 0].mean() > x[y == 0, 1].mean()) and (x[y == 1, 1].mean() > x[y == 1, 0].mean())
    keys = {k[0].split("-")[0] for k in ds.train_images.dask if isinstance(k, tuple)}
    assert "decode" in keys


def test_file_list_with_root_and_explicit_val_list(tmp_path, folder):
    entries = [(f"class_{c}/img_{i:03d}.jpg", c) for c in range(3) for i in range(6)]
    train = write_list(tmp_path / "train.txt", folder, entries)
    val = write_list(tmp_path / "val.lst", folder,
                     [(f"class_{c}/img_{i:03d}.jpg", c) for c in range(3) for i in (8, 9)])
    cfg = DataConfig(image_root=str(folder), val_source=str(val), image_size=16)
    info = data.inspect_dataset(str(train), cfg=cfg)
    assert (info["train"], info["test"], info["classes"]) == (18, 6, 3)
    assert info["label_names"] == ["0", "1", "2"]


def test_file_list_paths_are_relative_to_the_list_by_default(tmp_path, folder):
    lst = write_list(folder / "all.txt", folder,
                     [(f"class_{c}/img_000.jpg", c) for c in range(3)]
                     + [(f"class_{c}/img_001.jpg", c) for c in range(3)])
    with open(lst, "a") as f:
        f.write("\n# trailing comment\n")
    listing = imagefolder.read_file_list(str(lst))
    assert [f.label for f in listing.files] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("mode", ["L", "1", "P", "P-transparent", "RGBA", "LA", "CMYK", "I;16",
                                  "RGB16"])
def test_every_mode_becomes_rgb(tmp_path, mode):
    colour = np.array([200, 60, 30], np.uint8)
    rgb = np.broadcast_to(colour, (20, 30, 3)).copy()
    path = tmp_path / f"x_{mode.replace(';', '')}.png"
    if mode == "RGB16":
        png16(path, rgb.astype(np.uint16) * 257)
        expected = colour
    elif mode == "I;16":
        png16(path, np.full((20, 30), 120 * 257, np.uint16))
        expected = np.array([120] * 3)
    else:
        image = Image.fromarray(rgb)
        if mode == "P-transparent":
            image = image.convert("P")
            image.info["transparency"] = 255
        elif mode == "CMYK":
            path = path.with_suffix(".jpg")
            image = image.convert("CMYK")
        else:
            image = image.convert(mode)
        image.save(path, "JPEG" if mode == "CMYK" else "PNG")
        expected = np.asarray(Image.open(path).convert("RGBA").convert("RGB")).mean((0, 1))
    out = imagefolder.decode_file(imagefolder.ImageFile(str(path), 0, 0, 0), 8)
    assert out.shape == (3, 8, 8) and out.dtype == np.uint8
    assert np.abs(out.reshape(3, -1).mean(1) - expected).max() <= 4, (out[:, 0, 0], expected)


def test_exif_orientation_is_applied(tmp_path):
    pixels = np.zeros((20, 20, 3), np.uint8)
    pixels[:, :10] = 255  # left half white
    image = Image.fromarray(pixels)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display = rotate 90 degrees clockwise
    image.save(tmp_path / "o.jpg", exif=exif.tobytes(), quality=95)
    out = imagefolder.decode_file(imagefolder.ImageFile(str(tmp_path / "o.jpg"), 0, 0, 0), 10)
    assert out[0, :5].mean() > 200 and out[0, 5:].mean() < 50  # white on top after rotation


def test_draft_decode_matches_a_full_decode_closely(tmp_path):
    rng = np.random.default_rng(0)
    big = np.clip(rng.normal(128, 10, (480, 640, 3)).cumsum(1) % 255, 0, 255).astype(np.uint8)
    Image.fromarray(big).save(tmp_path / "big.jpg", quality=95)
    fast = imagefolder.decode_file(imagefolder.ImageFile(str(tmp_path / "big.jpg"), 0, 0, 0), 32)
    full = Image.open(tmp_path / "big.jpg").convert("RGB").resize(
        (32, 32), Image.BILINEAR, box=(80, 0, 560, 480))
    assert np.abs(fast.astype(int) - np.asarray(full).transpose(2, 0, 1)).mean() < 4


def test_eval_chunk_is_the_centre_of_a_larger_decode(folder):
    files = imagefolder.list_folder(str(folder)).files[:3]
    outer = imagefolder.decode_chunk(imagefolder.DecodeChunk(files, 37))[0]
    inner, labels = imagefolder.decode_chunk(imagefolder.DecodeChunk(files, 32, 0.875))
    assert inner.shape == (3, 3, 32, 32) and labels.dtype == np.int32
    np.testing.assert_array_equal(inner, outer[:, :, 2:34, 2:34])


def test_scan_reports_the_first_bad_file_and_how_many_more(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=3)
    for name in ("img_000.jpg", "img_001.jpg"):
        (root / "class_1" / name).write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"class_1/img_000.jpg: not an image .* \(and 1 more bad "
                                         r"file\)$"):
        data.load_dataset(str(root))


def test_scan_runs_as_scan_tasks_on_the_client(tmp_path, dask_client):
    root = write_folder(tmp_path / "f", classes=2, per_class=4)
    ds = data.load_dataset(str(root), DataConfig(decode_chunk=3), client=dask_client)
    assert ds.train_images.shape[0] + ds.test_images.shape[0] == 8
    keys = {k for k in dask_client.run_on_scheduler(
        lambda dask_scheduler: [str(t) for t in dask_scheduler.transition_log])}
    assert any("scan-" in k for k in keys)


def test_task_functions_and_values_pickle(folder):
    files = imagefolder.list_folder(str(folder)).files[:2]
    chunk = imagefolder.DecodeChunk(files, 16)
    stream = image_sources.Stream(files, 16, 1.0, 100, 8, "auto")
    for value in (imagefolder.decode_chunk, imagefolder.scan_files, image_sources.decode_images,
                  chunk, stream, files[0]):
        assert pickle.loads(pickle.dumps(value)) == value
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(imagefolder.decode_chunk))(chunk)[0],
                                  imagefolder.decode_chunk(chunk)[0])


def test_same_folder_same_keys_changed_file_new_keys(tmp_path):
    root = write_folder(tmp_path / "f", classes=2, per_class=4)
    a, b = data.load_dataset(str(root)), data.load_dataset(str(root))
    assert a.train_images.name == b.train_images.name
    (root / "class_0" / "img_000.jpg").write_bytes((root / "class_0" / "img_001.jpg").read_bytes())
    assert data.load_dataset(str(root)).train_images.name != a.train_images.name


def test_cache_decision_by_worker_memory():
    stream = image_sources.Stream((), 64, 1.0, 1, 128, "auto")
    assert image_sources.cache_decision(stream, 1000, [4 << 30, 0])[0]
    cached, note = image_sources.cache_decision(stream, 100_000, [1 << 30])
    assert not cached and "decoded again every epoch" in note and "1.1 GiB" in note
    assert image_sources.cache_decision(stream._replace(cache="on"), 100_000, [1 << 30])[0]
    assert not image_sources.cache_decision(stream._replace(cache="off"), 1, [])[0]


def test_readers_say_whether_they_check_their_files_on_the_driver(folder, tmp_path):
    cfg = DataConfig()
    listed = write_list(tmp_path / "train.txt", folder, [("class_0/img_000.jpg", 0)])
    assert data.checks_on_driver("synthetic:10:10", cfg) and data.checks_on_driver("cifar10", cfg)
    assert not data.checks_on_driver(str(folder), cfg)
    assert not data.checks_on_driver(str(listed), cfg)
    assert all(type(r.checks_on_driver) is bool for r in data.READERS)


def test_cifar_sources_refuse_another_image_size():
    with pytest.raises(DataError, match="data.image_size 64 applies to image folders"):
        data.load_dataset("synthetic:10:10", DataConfig(image_size=64))
