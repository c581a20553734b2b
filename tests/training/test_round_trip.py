"""Every kind of run reads back what it wrote: a tiny run of each data reader (CIFAR files,
synthetic, an image folder, a file list, the Tiny-ImageNet layout, NumPy arrays, Dask arrays,
Chainer datasets) and of a built-in and a user's model, then ``load_model``, ``predict``,
``evaluate --run`` and a resume of each, from the run directory alone."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import pipeline
from pipeline.core.errors import DataError
from pipeline.cli.parser import main
from pipeline.data.datasets import KINDS, READERS, facts
from tests.images import write_folder, write_list, write_split_folder, write_tiny_imagenet
from tests.helpers import user_code

USER_MODULE = textwrap.dedent('''
    import chainer
    import chainer.functions as F
    import chainer.links as L


    class RoundNet(chainer.Chain):
        def __init__(self, n_classes=10, width=4):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(None, width, 3, pad=1)
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            return self.fc(F.max_pooling_2d(F.relu(self.conv(x)), 4))
''')

BASE = {"train.strategy": "single", "train.replicas": 1, "train.batch_size": 16,
        "train.epochs": 1, "augment.policy": "flip", "progress": False, "checkpoint_every": 1}


def _arrays(n: int, side: int = 32, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 3, side, side), dtype=np.uint8),
            (np.arange(n) % classes).astype(np.int32))


def _numpy(tmp):
    return {"data": _arrays(60)}


def _dask(tmp):
    import dask.array as da
    x, y = _arrays(60)
    return {"data": (da.from_array(x, chunks=(25, 3, 32, 32)), da.from_array(y, chunks=25))}


def _chainer(tmp):
    from chainer.datasets import TupleDataset
    x, y = _arrays(60)
    xt, yt = _arrays(12, seed=1)
    return {"data": (TupleDataset(x.astype(np.float32) / 255, y),
                     TupleDataset(xt.astype(np.float32) / 255, yt))}


def _folder(tmp):
    return {"source": str(write_split_folder(tmp / "folder", classes=2, train=8, val=4))}


def _file_list(tmp):
    root = write_folder(tmp / "photos", classes=2, per_class=10)
    entries = [(f"class_{c}/img_{i:03d}.jpg", c) for c in range(2) for i in range(10)]
    return {"source": str(write_list(tmp / "photos" / "train.txt", root, entries))}


def _tiny_imagenet(tmp):
    return {"source": str(write_tiny_imagenet(tmp / "tiny-imagenet-200", classes=2, train=8))}


# name -> (what to train on, the data.dataset the run records)
CASES = {
    "cifar-file": (lambda tmp, cifar_dir: {"source": cifar_dir}, "cifar10"),
    "synthetic": (lambda tmp, cifar_dir: {"source": "synthetic:64:16"}, "synthetic"),
    "image-folder": (lambda tmp, cifar_dir: _folder(tmp), "image-folder"),
    "file-list": (lambda tmp, cifar_dir: _file_list(tmp), "file-list"),
    "tiny-imagenet": (lambda tmp, cifar_dir: _tiny_imagenet(tmp), "image-folder"),
    "numpy-arrays": (lambda tmp, cifar_dir: _numpy(tmp), "arrays"),
    "dask-arrays": (lambda tmp, cifar_dir: _dask(tmp), "arrays"),
    "chainer-datasets": (lambda tmp, cifar_dir: _chainer(tmp), "arrays"),
}


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """``roundnets.RoundNet`` outside the repository, written the way Chainer users write it
    (a plain ``import chainer`` at the top)."""
    with user_code(tmp_path_factory.mktemp("roundcode"), "roundnets", USER_MODULE) as module:
        yield module


def _image_size(source: str):
    return None if source.startswith("synthetic") or "cifar-10" in source else 16


def _read_back(out, model, name, images) -> dict:
    """load_model, predict (Python and the CLI) and evaluate --run of a finished run."""
    link = pipeline.load_model(out, model=model)
    record = json.loads((out / "data.json").read_text())
    side = record["image_shape"][-1]
    probe = images if images is not None else np.zeros((2, 3, side, side), np.uint8)
    result = pipeline.predict(out, probe, model=model)
    assert result.proba.shape == (len(probe), record["n_classes"])
    np.testing.assert_allclose(result.proba.sum(axis=1), 1, rtol=1e-5)
    flag = ["--model", name] if model is not None else []
    assert main(["evaluate", "--run", str(out), *flag]) == 0
    return {"link": type(link).__name__, "record": record}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("own_model", [False, True], ids=["built-in", "user-model"])
def test_every_kind_of_run_reads_back_what_it_wrote(case, own_model, tmp_path, cifar_dir,
                                                    dask_client, user_module, capsys):
    make, kind = CASES[case]
    given = make(tmp_path, cifar_dir)
    out = tmp_path / "run"
    fields = {"data.source": given.get("source", "synthetic")}
    if "source" in given:
        fields["data.image_size"] = _image_size(given["source"])
    config = pipeline.Config().replace(**{**BASE, "out": str(out), **fields})
    model = user_module.RoundNet if own_model else None
    name = "roundnets:RoundNet" if own_model else None
    data = given.get("data")
    first = pipeline.train(config, dask_client, data=data, model=model, log=lambda m: None)
    assert json.loads((out / "config.json").read_text())["data"]["dataset"] == kind
    capsys.readouterr()

    seen = _read_back(out, model, name, None)
    assert seen["record"]["kind"] == kind
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    split = facts(kind).eval_split  # evaluate names the split it read (val for image sources)
    assert printed["n"] == seen["record"]["images"][split] and f"{split}_acc" in printed

    if data is not None:  # arrays: resumed from Python with the same data; the CLI says so
        named = ["--model", name] if own_model else []
        assert main(["train", "--resume", str(out), "--epochs", "2", *named]) == 2
        assert "train(config, data=<the same arrays>, resume=True)" in capsys.readouterr().err
    more = config.replace(**{"train.epochs": 2})
    second = pipeline.train(more, dask_client, data=data, model=model, resume=True,
                            log=lambda m: None)
    assert second.history[-1]["round"] > first.history[-1]["round"]
    assert second.history[:len(first.history)] == first.history
    _read_back(out, model, name, None)


def test_the_kinds_are_the_readers_own():
    """One list: every reader's recorded kinds, nothing else (config.json, data.json, evaluate,
    predict and the progress bar all ask the reader)."""
    assert KINDS == tuple(k for r in READERS for k in r.recorded())
    assert set(KINDS) == {"arrays", "synthetic", "file-list", "image-folder", "cifar10",
                          "cifar100"}
    assert [facts(k).eval_split for k in ("cifar10", "image-folder", "arrays")] == \
        ["test", "val", "test"]
    with pytest.raises(DataError, match="data.dataset must be one of arrays"):
        facts("parquet")
    with pytest.raises(DataError, match="data.dataset must be one of"):  # before any cluster
        pipeline.train(pipeline.Config().replace(**{"data.dataset": "parquet"}))


def test_a_run_directory_naming_an_unknown_kind_is_one_line(tmp_path, dask_client, capsys):
    out = tmp_path / "run"
    config = pipeline.Config().replace(**{**BASE, "out": str(out),
                                          "data.source": "synthetic:32:8"})
    pipeline.train(config, dask_client, log=lambda m: None)
    saved = json.loads((out / "config.json").read_text())
    saved["data"]["dataset"] = "parquet"
    (out / "config.json").write_text(json.dumps(saved))
    assert main(["evaluate", "--run", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config.json" in err and "parquet" in err
