"""train(config, data=...): Dask arrays, NumPy arrays and Chainer datasets as a reader: layouts
converted or refused in one line, labels checked, a fingerprint independent of chunking, and
training byte-identical for any chunking, 1 or 3 workers, and the same images as a CIFAR source."""
from __future__ import annotations

import contextlib

import dask.array as da
import numpy as np
import pytest

from pipeline.core.config import DataConfig
from pipeline.core.errors import DataError, ResumeError
from pipeline.data import arrays
from pipeline.data import datasets as data
from pipeline.training.loop import train
from tests.helpers import assert_same_bits, make_config


def _images(n: int = 40, side: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, side, side, 3) uint8 with the class in the red channel's mean, labels 0..3."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 4
    x = rng.integers(0, 128, (n, side, side, 3), dtype=np.uint8)
    x[..., 0] += (y * 40).astype(np.uint8)[:, None, None]
    return x, y


def _plan(source, **fields):
    return data._plan(source, DataConfig(**fields), False)


def test_layouts_become_nchw_uint8_and_keep_their_blocks():
    x, y = _images()
    nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    for given in (x, nchw, da.from_array(x, chunks=(7, 16, 16, 3)),
                  da.from_array(x, chunks=(7, 4, 16, 3))):
        ds = data.load_dataset((given, y, given[:8], y[:8]))
        assert ds.train_images.dtype == np.uint8 and ds.train_images.shape == (40, 3, 16, 16)
        assert ds.train_images.compute().tobytes() == nchw.tobytes()
        assert ds.train_labels.chunks == (ds.train_images.chunks[0],)
    assert data.load_dataset((da.from_array(x, chunks=7), y, x, y)).train_images.chunks[0] == \
        (7,) * 5 + (5,)
    floats = x.astype(np.float32) / 255  # chainer.datasets.get_cifar10(): float32 in [0, 1]
    got = data.load_dataset((floats, y, floats[:4], y[:4])).train_images.compute()
    assert got.tobytes() == nchw.tobytes()
    gray = data.load_dataset((x[..., :1], y)).train_images.compute()
    assert (gray == gray[:, :1]).all()


def test_chainer_datasets_tuple_and_labeled_image(tmp_path):
    from pipeline.backends.chainer.compat import chainer
    from PIL import Image
    x, y = _images(12)
    nchw = x.transpose(0, 3, 1, 2)
    pair = (chainer.datasets.TupleDataset(nchw.astype(np.float32) / 255, y.astype(np.int32)),
            chainer.datasets.TupleDataset(nchw[:4].astype(np.float32) / 255, y[:4]))
    ds = data.load_dataset(pair)
    assert ds.train_images.compute().tobytes() == np.ascontiguousarray(nchw).tobytes()
    for i, image in enumerate(x):
        Image.fromarray(image).save(tmp_path / f"{i}.png")
    labeled = chainer.datasets.LabeledImageDataset([(f"{i}.png", int(y[i])) for i in range(12)],
                                                   str(tmp_path))  # float32 CHW in [0, 255]
    info = data.inspect_dataset(labeled)
    assert (info["train"] + info["test"], info["kind"]) == (12, "chainer datasets")
    assert data.load_dataset((labeled, labeled)).train_images.compute().tobytes() == \
        np.ascontiguousarray(nchw).tobytes()


BAD = [
    ("flat images", lambda x, y: (x.reshape(40, -1), y), "x_train: shape (40, 768) is not "
     "(N, 3, H, W) or (N, H, W, 3)"),
    ("no channel axis", lambda x, y: (x[..., :2], y), "has no 3-channel axis"),
    ("float out of range", lambda x, y: (x.astype(np.float32) * 2, y), "x_train: float32 "
     "values in [0, 494]; expected uint8, or floats in [0, 1] or [0, 255]"),
    ("float labels", lambda x, y: (x, y.astype(np.float32)), "y_train: dtype float32, "
     "expected integer labels"),
    ("label count", lambda x, y: (x, y[:-1]), "y_train: shape (39,), expected (40,)"),
    ("negative label", lambda x, y: (x, np.where(np.arange(40) == 5, -1, y)), "y_train: "
     "label -1 at row 5 is negative"),
    ("empty class", lambda x, y: (x, np.where(y == 2, 3, y)), "no image for class 2"),
    ("test label range", lambda x, y: (x, y, x[:4], np.array([0, 1, 2, 4])), "y_test: label 4 "
     "at row 3 is out of range (labels are 0..3)"),
    ("test size", lambda x, y: (x, y, x[:4, :8, :8], y[:4]), "x_test: images are 3x8x8, "
     "x_train's 3x16x16"),
    ("not square", lambda x, y: (x[:, :, :8], y), "square images expected"),
    ("n_classes too small", lambda x, y: {"x_train": x, "y_train": y, "n_classes": 3},
     "y_train: label 3 at row 3 is out of range (labels are 0..2)"),
    ("one class", lambda x, y: {"x_train": x, "y_train": y * 0, "n_classes": 1},
     "n_classes: 1; at least 2 classes needed"),
    ("names", lambda x, y: {"x_train": x, "y_train": y, "label_names": ("a", "b")},
     "label_names: 2 names for 4 classes"),
    ("unknown chunks", lambda x, y: (da.from_array(x, chunks=10)[da.from_array(y) > 0], y),
     "call x_train.compute_chunk_sizes() first"),
    ("a list of strings", lambda x, y: (["a"] * 3, y), "x_train: a dataset of (image, label) "
     "pairs expected, its first example is a str"),
    ("a number", lambda x, y: 5, "data: expected Dask or NumPy arrays (x_train, y_train"),
]


@pytest.mark.parametrize("make, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_violation_is_one_line(make, expected):
    with pytest.raises(DataError) as err:
        _plan(make(*_images()))
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_n_classes_allows_classes_without_images_and_image_size_must_match():
    x, y = _images()
    plan = _plan({"x_train": x, "y_train": y, "n_classes": 6})
    assert len(plan.label_names) == 6 and plan.class_counts_train[4:] == (0, 0)
    with pytest.raises(DataError, match="data.image_size 32: the arrays' images are 3x16x16"):
        _plan((x, y), image_size=32)


def test_fingerprint_is_the_data_not_its_chunking():
    x, y = _images()
    prints = {_plan((da.from_array(x, chunks=c), y)).source for c in (5, 13, 40)}
    assert len(prints) == 1 and prints.pop().startswith("arrays:")
    changed = x.copy()
    changed[17, 3, 3, 1] ^= 1
    assert _plan((changed, y)).source != _plan((x, y)).source
    assert _plan((x, (y + 1) % 4)).source != _plan((x, y)).source


def test_held_out_split_is_stratified_and_seeded():
    x, y = _images()
    plan = _plan((x, y), val_fraction=0.3)
    assert sum(b.n for b in plan.test) == 12 and plan.class_counts_train == (7, 7, 7, 7)
    assert _plan((x, y), val_fraction=0.3).ident == plan.ident
    assert _plan((x, y), val_fraction=0.3, split_seed=1).ident != plan.ident


BASE = {"model.name": "small-cnn", "train.strategy": "ipm", "train.replicas": 2,
        "train.batch_size": 8, "train.epochs": 1.0, "average.mix_every": "2",
        "augment.policy": "cifar", "augment.chunk": 16, "progress": False, "seed": 3}


@contextlib.contextmanager
def _cluster(workers: int):
    import distributed
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=False,
                                  dashboard_address="127.0.0.1:0") as cluster, \
            distributed.Client(cluster, set_as_default=False) as client:
        yield client


def test_training_is_byte_identical_for_chunkings_workers_and_a_cifar_source(tmp_path):
    ds = data.load_dataset("synthetic:96:32")
    x, y, tx, ty = data.dataset_arrays(ds)
    config = make_config(BASE)
    with _cluster(1) as one:
        reference = train(config.replace(**{"data.source": "synthetic:96:32"}), one,
                          log=lambda m: None).params
        logs = []
        chunked = train(config, one, data=(da.from_array(x, chunks=50), y, tx, ty),
                        log=logs.append)
    assert_same_bits(reference, chunked.params, "dask arrays vs the CIFAR source")
    assert chunked.config.data.source.startswith("arrays:")
    assert any(m.startswith("data: dask arrays, 96 train / 32 test images of 3x32x32") for m in logs)
    assert any(m.startswith("memory on the workers: training images 288.0 KiB") for m in logs)
    with _cluster(3) as three:
        nhwc = da.from_array(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), chunks=(7, 32, 32, 3))
        held = three.persist(nhwc)  # the blocks are on the workers; train finds their client
        logs = []
        result = train(config, data=(held, da.from_array(y, chunks=11), tx, ty),
                       log=logs.append)
        assert not any("started local cluster" in m for m in logs), logs
    assert_same_bits(reference, result.params, "3 workers, persisted NHWC blocks of 7")


def test_resume_refuses_other_data(tmp_path):
    x, y = _images()
    config = make_config({**BASE, "train.strategy": "single", "train.replicas": 1,
                          "train.epochs": 1.0, "out": str(tmp_path / "run"),
                          "checkpoint_every": 1})
    with _cluster(1) as client:
        train(config, client, data=(x, y), log=lambda m: None)
        changed = x.copy()
        changed[0, 0, 0, 0] ^= 1
        with pytest.raises(ResumeError, match=r"data.source is 'arrays:[0-9a-f]{16}' there and "
                                              r"'arrays:[0-9a-f]{16}' now"):
            train(config.replace(**{"train.epochs": 2.0}), client, data=(changed, y),
                  resume=True, log=lambda m: None)
        done = train(config.replace(**{"train.epochs": 2.0}), client, data=(x, y), resume=True,
                     log=lambda m: None)
    assert done.history


def test_a_recorded_arrays_source_without_the_data_is_one_line():
    with pytest.raises(DataError, match=r"resume it in Python with train\(config, "
                                        r"data=<the same arrays>, resume=True\)"):
        data.load_dataset("arrays:0123456789abcdef")


def test_kernels_pickle_and_are_pure():
    import pickle
    block = np.arange(24, dtype=np.uint8).reshape(2, 3, 2, 2)
    assert pickle.loads(pickle.dumps(arrays.row_hashes))(block).shape == (2,)
    assert arrays.row_hashes(block)[0] != arrays.row_hashes(block)[1]
    assert pickle.loads(pickle.dumps(arrays.to_uint8)) is arrays.to_uint8


def _store(tmp_path, x: np.ndarray, y: np.ndarray) -> tuple:
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return str(tmp_path / "x.npy"), str(tmp_path / "y.npy")


def test_recipe_npy_store_to_dask_array_to_train(tmp_path):
    """README 'Your arrays': images in a store on disk -> a Dask array read on the workers ->
    train; the same bytes as the arrays in memory."""
    x, y, tx, ty = data.dataset_arrays(data.load_dataset("synthetic:96:32"))
    xs, ys = _store(tmp_path, x.transpose(0, 2, 3, 1), y)  # stored NHWC, as most stores are
    images = arrays.from_store(xs, rows=40)
    assert images.chunks[0] == (40, 40, 16)
    assert [layer.split("-")[0] for layer in images.dask.layers] == ["read"]
    config = make_config(BASE)
    with _cluster(2) as client:
        stored = train(config, client, data=(images, arrays.from_store(ys), tx, ty),
                       log=lambda m: None)
        in_memory = train(config, client, data=(x, y, tx, ty), log=lambda m: None)
    assert_same_bits(in_memory.params, stored.params, "npy store vs memory")
    assert stored.config.data.source == in_memory.config.data.source


def test_recipe_hdf5_and_zarr(tmp_path):
    x, y = _images()
    expected = _plan((x, y)).source
    h5py = pytest.importorskip("h5py")  # not a dependency: the recipe works where it is installed
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, y
    path = str(tmp_path / "d.h5")
    assert _plan((arrays.from_store(path, "x", rows=9), arrays.from_store(path, "y"))).source \
        == expected
    zarr = pytest.importorskip("zarr")
    zarr.save(str(tmp_path / "x.zarr"), x)
    assert _plan((da.from_zarr(str(tmp_path / "x.zarr")), y)).source == expected


def test_numpy_data_past_the_large_graph_limit_trains_without_distributed_warning():
    """NumPy blocks travel in the graph on purpose (the scheduler can rebuild a lost block):
    distributed's "Sending large graph" advice is not shown for them; the limit is restored."""
    import warnings

    import dask
    x, y = _images(200, 32)  # 614 KB of images against a 100 kB limit
    config = make_config({**BASE, "train.epochs": 0.1})
    with dask.config.set({arrays.GRAPH_LIMIT: "100kB"}), _cluster(1) as client, \
            warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = train(config, client, data=(x, y, x[:40], y[:40]), log=lambda m: None)
        assert dask.config.get(arrays.GRAPH_LIMIT) == "100kB"
        with pytest.warns(UserWarning, match="Sending large graph"):  # the limit is in force
            client.compute(da.from_array(x, chunks=50).sum()).result()
    assert result.history
