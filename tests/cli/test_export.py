"""Results that leave the project (the export half): `python -m pipeline export` and
`pipeline.export` write a run's network as an ONNX graph (pixels 0-255 in, the normalisation
inside, dynamic batch, class names in its metadata); onnxruntime gives the same top-1 class as
`pipeline.predict` on every image and probabilities within `ATOL`; `predict --onnx` runs the file
without Chainer; a function with no ONNX form is one line naming it, exit 2.

Runs are tiny (`single`, synthetic:64:16, one epoch) on the in-process cluster.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

import pipeline
from pipeline.cli.parser import main
from pipeline.core.errors import UsageError
from pipeline.data.cifar.synthetic import synthetic_batch
from tests.helpers import REPO, run_cli, user_code
from tests.images import photo, write_split_folder

_MISSING = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
if _MISSING and os.environ.get("CI") != "true":  # under CI the [onnx] extra is installed
    pytest.skip(f"{', '.join(_MISSING)} not installed (pip install -e '.[onnx]')",
                allow_module_level=True)

# Probabilities of the ONNX graph (onnxruntime's MLAS kernels) and of predict (our NumPy
# kernels) differ by float32 rounding in other summation orders: at most 9.5e-7 measured on these
# runs (resnet20's; 2e-7 to 7e-7 for the others); 1e-5 leaves 10x headroom and is still far below
# any difference a wrong pad, layout or normalisation makes (those move probabilities by 1e-2).
ATOL = 1e-5

USER_NETS = textwrap.dedent('''
    import chainer
    import chainer.functions as F
    import chainer.links as L


    class StockNet(chainer.Chain):
        """Chainer's stock links and functions only."""
        def __init__(self, n_classes=10):
            super().__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, 8, 3, pad=1)
                self.bn = L.BatchNormalization(8)
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            h = F.max_pooling_2d(F.relu(self.bn(self.conv(x))), 3, stride=2)  # cover_all
            return self.fc(F.dropout(h, 0.3))


    class SineNet(chainer.Chain):
        def __init__(self, n_classes=10):
            super().__init__()
            with self.init_scope():
                self.fc = L.Linear(None, n_classes)

        def forward(self, x):
            return self.fc(F.sin(x))
''')

BASE = {"train.strategy": "single", "train.replicas": 1, "train.batch_size": 16,
        "train.epochs": 1, "train.lr": 0.01, "augment.policy": "flip", "progress": False,
        "checkpoint_every": 0, "data.source": "synthetic:64:16", "seed": 3}
NETS = ("small-cnn", "resnet20", "cifar10-2015", "wide-mlp", "exportnets:StockNet")


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("exportcode")
    with user_code(root, "exportnets", USER_NETS):
        yield root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dask_client, user_module):
    """name -> run directory, one tiny run of each net."""
    import exportnets
    tmp, made = tmp_path_factory.mktemp("export"), {}
    for name in (*NETS, "exportnets:SineNet"):
        own = getattr(exportnets, name.split(":")[1]) if ":" in name else None
        out = tmp / name.replace(":", "_")
        config = pipeline.Config().replace(**{**BASE, "out": str(out),
                                              "model.name": name if own is None else "small-cnn"})
        pipeline.train(config, dask_client, model=own, log=lambda m: None)
        made[name] = out
    return made


def _model(name):
    if ":" not in name:
        return None
    import exportnets
    return getattr(exportnets, name.split(":")[1])


@pytest.mark.parametrize("name", NETS)
def test_onnxruntime_gives_predicts_classes_and_probabilities(name, runs, tmp_path):
    import onnx
    import onnxruntime
    path = pipeline.export(runs[name], tmp_path / "model.onnx", model=_model(name))
    images, _ = synthetic_batch(7, "test", 0, 16)
    expected = pipeline.predict(runs[name], images, model=_model(name))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["class_names"]) == expected.class_names
    assert (meta["image_size"], meta["layout"], meta["pixels"]) == ("32", "NCHW RGB",
                                                                    "float32 0-255")
    graph = onnx.load(str(path)).graph
    assert [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim[:1]] == ["N"]
    got = session.run(["probabilities"], {"pixels": images.astype(np.float32)})[0]
    assert (got.argmax(axis=1) == expected.proba.argmax(axis=1)).all()
    np.testing.assert_allclose(got, expected.proba, atol=ATOL, rtol=0)
    for n in (1, 7):  # the batch axis is dynamic
        part = session.run(["probabilities"], {"pixels": images[:n].astype(np.float32)})[0]
        assert part.shape == (n, len(expected.class_names))
        np.testing.assert_allclose(part, expected.proba[:n], atol=ATOL, rtol=0)


def test_a_function_without_an_onnx_form_is_one_line_naming_it(runs, tmp_path, user_module,
                                                               capsys):
    run = runs["exportnets:SineNet"]
    with pytest.raises(UsageError, match="Sin "):
        pipeline.export(run, tmp_path / "sine.onnx", model=_model("exportnets:SineNet"))
    capsys.readouterr()
    code = main(["export", "--run", str(run), "--model", "exportnets:SineNet",
                 "--out", str(tmp_path / "sine.onnx")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Chainer's Sin" in err, err
    assert not (tmp_path / "sine.onnx").exists()


def test_predict_onnx_reads_images_as_predict_does_without_chainer(tmp_path, dask_client):
    """An image folder run (16 x 16 from the centre 87.5%): export on the command line, then
    `predict --onnx` in a fresh process, where Chainer is never imported."""
    root = write_split_folder(tmp_path / "flowers", classes=2, train=8, val=4)
    out = tmp_path / "run"
    config = pipeline.Config().replace(**{**BASE, "out": str(out), "data.source": str(root),
                                          "data.image_size": 16, "model.name": "small-cnn"})
    pipeline.train(config, dask_client, log=lambda m: None)
    done = run_cli("export", "--run", str(out), "--format", "onnx",
                   "--out", str(tmp_path / "model.onnx"))
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(5)
    photos = tmp_path / "new"
    photos.mkdir()
    for i, c in enumerate((0, 1, 0, 1)):
        Image.fromarray(photo(c, rng, 80, 60)).save(photos / f"p{i}.png")
    script = ("import sys; from pipeline.cli.parser import main; "
              f"code = main(['predict', '--onnx', {str(tmp_path / 'model.onnx')!r}, "
              f"'--format', 'json', '--top', '2', {str(photos)!r}]); "
              "print('chainer' in sys.modules, file=sys.stderr); sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.strip().splitlines()[-1] == "False", done.stderr
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    expected = pipeline.predict(out, photos)
    assert [line["image"] for line in lines] == expected.images
    for line, top in zip(lines, expected.top(2)):
        assert line["top"][0]["class"] == top[0][0]
        assert abs(line["top"][0]["probability"] - round(top[0][1], 4)) <= 1e-4


def test_bad_exports_are_one_line(runs, tmp_path, capsys):
    assert main(["predict", "--onnx", str(tmp_path / "none.onnx"), "x.png"]) == 2
    assert "none.onnx" in capsys.readouterr().err
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    assert main(["predict", "--onnx", str(tmp_path / "junk.onnx"), "x.png"]) == 2
    assert "not an ONNX model" in capsys.readouterr().err
    assert main(["predict", "x.png"]) == 2
    assert "--run --onnx" in capsys.readouterr().err
    assert main(["export", "--run", str(runs["small-cnn"]), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch,side", [("resnet50", 32), ("googlenet", 224)])
def test_the_zoo_nets_convert(arch, side):
    """Chainer's ImageNet architectures (random weights): their op sets (BatchNorm, LRN,
    concatenated branches, global pooling) through the same converter. Untrained, resnet50's
    logits reach +-250 and its softmax is one-hot, so the logits are compared, to 1e-5 of
    their largest. VGG16 (convolutions, max pooling, linear layers: all above) is left out:
    528 MB and 15 GFLOP an image."""
    import augment
    import onnxruntime
    from pipeline.backends import get_backend
    from pipeline.backends.chainer.compat import chainer
    backend = get_backend()
    ref = backend.resolve_model(arch, "{}", None, (side, side), 10)
    params = backend.init_params(ref, 10, 1)
    from pipeline.training import tasks
    data = backend.export_onnx(params, tasks.EvalSpec(ref, 10), side, {"class_names": "[]"})
    images = np.random.default_rng(1).integers(0, 256, (2, 3, side, side), dtype=np.uint8)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"pixels": images.astype(np.float32)})[0]
    link = backend.to_model(ref, 10, params)
    with chainer.using_config("train", False), chainer.no_backprop_mode():
        expected = link(augment.normalize(images)).array
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()
    np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def _converted(model, side: int, seed: int = 1):
    """(onnxruntime's probabilities, predict_proba's) of a freshly initialised ``model``."""
    import onnxruntime
    from pipeline.backends import get_backend
    from pipeline.training import tasks
    backend = get_backend()
    params = backend.init_params(model, 10, seed)
    spec = tasks.EvalSpec(model, 10)
    data = backend.export_onnx(params, spec, side, {"class_names": "[]"})
    images = np.random.default_rng(seed).integers(0, 256, (3, 3, side, side), dtype=np.uint8)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return (session.run(["probabilities"], {"pixels": images.astype(np.float32)})[0],
            tasks.predict_proba(params, images, spec))


@pytest.mark.parametrize("name", ["small-cnn", "cifar10-2015", "wide-mlp"])
def test_sizes_off_the_pooling_grid_convert(name):
    """At 40 x 40: the pyramid's max pooling pads and covers all (cifar10-2015: 10 x 10 into 3
    x 3 bins), small-cnn's and wide-mlp's average to 4 x 4 / 32 x 32 take the adaptive bins
    (slices, means, a stack)."""
    got, expected = _converted(name, 40)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
