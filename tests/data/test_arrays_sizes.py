"""Arrays that lie and sizes taken on trust (train(config, data=...)): a Dask array whose blocks
are not what it declares is refused naming the block; labels, n_classes, a dataset's len and
class names are bounded before anything is sized by them; float chunks are scaled in pieces.
Random shapes, dtypes and sizes give a DataError or a result, never a MemoryError or an
IndexError."""
from __future__ import annotations

import tracemalloc

import dask
import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.config import DataConfig
from pipeline.core.errors import DataError
from pipeline.data import arrays
from pipeline.data import datasets as data


def _plan(source, **fields):
    return data._plan(source, DataConfig(**fields), False)


def _images(n: int = 40, side: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (n, side, side, 3), dtype=np.uint8), np.arange(n) % 4


def _lying(block_shape: tuple, dtype=np.uint8) -> da.Array:
    """Four blocks declared (10, 8, 8, 3) uint8; the third one is ``block_shape`` ``dtype``."""
    parts = []
    for i in range(4):
        shape, kind = (block_shape, dtype) if i == 2 else ((10, 8, 8, 3), np.uint8)
        made = dask.delayed(np.ones)(shape, kind)
        parts.append(da.from_delayed(made, (10, 8, 8, 3), dtype=np.uint8))
    return da.concatenate(parts)


@pytest.mark.parametrize("shape, dtype", [((5, 8, 8, 3), np.uint8), ((12, 8, 8, 3), np.uint8),
                                          ((10, 16, 16, 3), np.uint8),
                                          ((10, 8, 8, 3), np.float64)],
                         ids=["fewer rows", "more rows", "larger images", "other dtype"])
def test_a_block_unlike_its_declared_chunk_is_refused_naming_it(shape, dtype):
    y = np.arange(40) % 4
    with pytest.raises(DataError) as err:
        _plan((_lying(shape, dtype), y))
    text = str(err.value)
    assert text.startswith("x_train: block (2, 0, 0, 0) holds a ") and "declares (10, 8, 8, 3) " \
        "uint8" in text and "\n" not in text, text
    with pytest.raises(DataError, match="x_test: block"):  # the test split too
        _plan((_images()[0], y, _lying(shape, dtype), y))


def test_labels_whose_blocks_lie_are_refused():
    x, y = _images()
    short = da.from_delayed(dask.delayed(np.remainder)(np.arange(30), 4), (40,), dtype=np.int64)
    with pytest.raises(DataError, match=r"y_train: its blocks hold a \(30,\) int64 array, its "
                       r"Dask array declares \(40,\) integer labels"):
        _plan((x, short))


def test_honest_blocks_keep_their_bytes():
    x, y = _images()
    plan = _plan((da.from_array(x, chunks=(7, 8, 8, 3)), y))
    got = da.concatenate([plan.arrays[0], plan.arrays[2]]).compute()
    assert sorted(map(bytes, got)) == sorted(map(bytes, x.transpose(0, 3, 1, 2)))


SIZES = [
    ("float images, none", lambda x, y: (x[:0].astype(np.float32), y[:0]),
     "data: x_train holds no image"),
    ("numpy images, none", lambda x, y: (x[:0], y[:0]), "data: x_train holds no image"),
    ("dask test images, none", lambda x, y: (x, y, da.from_array(x[:0]), y[:0]),
     "data: x_test holds no image"),
    ("a label of 10^9", lambda x, y: (x, np.where(np.arange(40) == 3, 10 ** 9, y)),
     "y_train: label 1000000000 at row 3 is out of range: 40 images with every class present "
     "hold labels 0..39 at most"),
    ("uint64 labels", lambda x, y: (x, y.astype(np.uint64)), None),
    ("n_classes of 10^7", lambda x, y: {"x_train": x, "y_train": y, "n_classes": 10 ** 7},
     "n_classes: 10000000; at most 100000 classes (model.n_classes' limit)"),
    ("n_classes not an integer", lambda x, y: {"x_train": x, "y_train": y, "n_classes": "4"},
     "n_classes: '4'; expected an integer"),
    ("images of 2048 a side", lambda x, y: (np.zeros((8, 3, 2048, 2048), np.uint8), y[:8]),
     "x_train: images are 3x2048x2048; at most 1024 pixels a side"),
    ("a long class name", lambda x, y: {"x_train": x, "y_train": y,
                                        "label_names": ("a", "b", "c", "d" * 300)},
     "label_names: class 3's name is 300 characters"),
    ("label_names a string", lambda x, y: {"x_train": x, "y_train": y, "label_names": "abcd"},
     "label_names: a str, expected a list of names"),
]


@pytest.mark.parametrize("make, expected", [s[1:] for s in SIZES], ids=[s[0] for s in SIZES])
def test_sizes_are_bounded_before_allocation_in_one_line(make, expected):
    if expected is None:
        assert _plan(make(*_images())).label_names == ("0", "1", "2", "3")
        return
    with pytest.raises(DataError) as err:
        _plan(make(*_images()))
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


class _Claims:
    """A Chainer-style dataset whose ``len`` says ``n`` and that holds ``held`` examples."""

    def __init__(self, n: int, held: int):
        self.n, self.held = n, held

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.held:
            raise IndexError(i)
        return np.full((3, 8, 8), i % 2, np.float32), i % 2


def test_a_dataset_len_is_bounded_by_memory_and_checked_by_reading():
    with pytest.raises(DataError, match=r"x_train: the dataset's len is 1000000000000 examples "
                       r"of \(3, 8, 8\) float32, 698.5 TiB: more than this machine's"):
        _plan(_Claims(10 ** 12, 4))
    with pytest.raises(DataError, match=r"x_train: example 6 cannot be read \(IndexError: 6\), "
                       r"though the dataset's len is 10"):
        _plan(_Claims(10, 6))


def test_float_blocks_are_scaled_in_pieces():
    block = np.random.default_rng(0).random((64, 3, 256, 256), dtype=np.float32)  # 48 MiB
    expected = np.concatenate([np.clip(np.rint(part.astype(np.float64) * 255), 0, 255)
                               .astype(np.uint8) for part in np.split(block, 16)])
    tracemalloc.start()
    try:
        got = arrays.to_uint8(block, 255.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.tobytes() == expected.tobytes()
    assert peak < block.nbytes, peak  # out + two 8 MiB pieces; whole: float64 copies of 2x


@st.composite
def _fuzzed(draw) -> dict:
    """Random data of random shape, dtype and labels; some Dask arrays lie about their blocks."""
    n, side = draw(st.integers(0, 12)), draw(st.integers(1, 6))
    channels = draw(st.sampled_from([1, 3]))
    square = [(n, channels, side, side), (n, side, side, channels)]
    shape = draw(st.sampled_from(square * 2 + [(n, 3, side, side + 1), (n, side), (n,)]))
    ndim = len(shape)
    dtype = draw(st.sampled_from([np.uint8, np.int64, np.float32, np.float64, bool, np.complex64]))
    dtype = draw(st.sampled_from([dtype, np.uint8, np.uint8]))
    value = draw(st.sampled_from([0, 1, 1, 200, 300, -1, np.inf]))
    with np.errstate(all="ignore"):
        x = (np.ones(shape) * value).astype(dtype)
    if draw(st.sampled_from([False, False, True])) and ndim and shape[0]:
        rows = draw(st.integers(1, 9))
        made = dask.delayed(np.zeros)((rows,) + shape[1:], dtype)
        x = da.from_delayed(made, shape, dtype=dtype)
    n = shape[0] if ndim else 0
    y = np.arange(n + draw(st.sampled_from([0, 0, 0, 1]))) % draw(st.sampled_from([2, 2, 3, 1]))
    if n and draw(st.sampled_from([False, False, True])):
        y[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, 7, 10 ** 9, 2 ** 62]))
    y = y.astype(draw(st.sampled_from([np.int64, np.int64, np.uint64, np.float32])))
    return {"x_train": x, "y_train": y,
            "n_classes": draw(st.sampled_from([None, None, -1, 0, 2, 4, 10 ** 7, 10 ** 12, 2.5])),
            "label_names": draw(st.sampled_from([None, ("a", "b"), ("x" * 300,) * 3]))}


@given(_fuzzed())
@settings(max_examples=120, deadline=None, derandomize=True)
def test_random_arrays_give_a_plan_or_a_data_error(given_):
    try:
        plan = _plan(given_)
    except DataError as err:
        assert "\n" not in str(err), str(err)
        return
    assert plan.arrays[0].dtype == np.uint8 and len(plan.label_names) >= 2
