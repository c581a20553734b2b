"""Benchmark: image folders decoded and augmented on CPU workers, against a per-image PIL loop.

Writes its own folder of ``--images`` JPEGs of mixed sizes (320x240 to 1600x1200, four classes)
under a temp dir, then measures, all in one run:

1. decoders, one process, per image to ``--image-size`` (shorter side, centre crop): Pillow full
   decode, Pillow with JPEG draft (DCT-domain downscaling; what ``decode-`` tasks use) and
   simplejpeg when it is installed (libjpeg-turbo with the same scaling). Interleaved repeats,
   best of ``--repeats``.
2. decode + augment (random-resized-crop + flip) images/s: the torchvision-style per-image PIL
   loop (full decode, crop and resize of the full image, flip, to array) in one process, and an
   epoch of what an uncached run loads (each round's ``decode-`` tasks and its vectorized
   ``augment-`` task, as the driver submits them) on one worker process and on two.
   Goal: ``decode_2w_over_1w`` >= 1.8.
3. an epoch of small-cnn at the image size where loading dominates, on one one-thread training
   worker and one one-thread loader worker (``--loader-workers 1``: the two cores split as a GPU
   box's are, training on its device and decoding on CPU cores beside it, as the loader
   processes of Chainer's MultiprocessIterator overlap with compute, docs/references.md):
   training alone (decoded images cached on the loader),
   loading alone (the epoch's decode- and augment- tasks on the loader, no training) and the
   full pipeline decoding every round. Goal: ``epoch_over_max`` = epoch / max(train, loading)
   <= 1.1; ``loading_over_train`` says which stage dominates. ``epoch-shared`` repeats it on
   one worker process with two threads (both stages share both cores: bound by their sum) for
   comparison.

    flock /work/cpu.lock .venv/bin/python benchmarks/decode.py        # ~4 min on 2 cores
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import emit, local_client  # noqa: I001

SIZES = ((320, 240), (500, 375), (640, 480), (800, 600), (1024, 768), (1600, 1200), (375, 500),
         (480, 640))


def write_jpegs(root: Path, n: int, classes: int = 4, seed: int = 0) -> Path:
    """``n`` photo-like JPEGs (smooth colour fields, texture, a shape), quality 90."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = i % classes
        w, h = SIZES[i % len(SIZES)]
        small = rng.normal(0, 1, (h // 16 + 2, w // 16 + 2, 3)).cumsum(0).cumsum(1)
        small = (small - small.min()) / (np.ptp(small) + 1e-9) * 160 + 40
        field = np.asarray(Image.fromarray(small.astype(np.uint8)).resize((w, h), Image.BICUBIC),
                           np.float64)
        field[..., label % 3] += 50
        field += rng.normal(0, 12, (h, w, 1))
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(field, 0, 255).astype(np.uint8)).save(
            folder / f"{i:05d}.jpg", quality=90)
    return root


# ---- 1. decoders -----------------------------------------------------------------------------


def _square(image, size):
    from PIL import Image
    w, h = image.size
    s = min(w, h)
    box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
    return np.asarray(image.resize((size, size), Image.BILINEAR, box=box))


def pil_full(blob: bytes, size: int):
    from PIL import Image
    return _square(Image.open(io.BytesIO(blob)).convert("RGB"), size)


def pil_draft(blob: bytes, size: int):
    from PIL import Image
    image = Image.open(io.BytesIO(blob))
    w, h = image.size
    scale = size / min(w, h)
    image.draft("RGB", (int(np.ceil(w * scale)), int(np.ceil(h * scale))))
    return _square(image.convert("RGB"), size)


def simplejpeg_scaled(blob: bytes, size: int):
    import simplejpeg
    from PIL import Image
    w, h = simplejpeg.decode_jpeg_header(blob)[:2]
    scale = size / min(w, h)
    array = simplejpeg.decode_jpeg(blob, colorspace="RGB", min_width=int(np.ceil(w * scale)),
                                   min_height=int(np.ceil(h * scale)))
    return _square(Image.fromarray(array), size)


def decoders(files, size: int, repeats: int) -> dict:
    blobs = [Path(f).read_bytes() for f in files]
    candidates = {"pillow_full": pil_full, "pillow_draft": pil_draft}
    try:
        import simplejpeg  # noqa: F401
        candidates["simplejpeg"] = simplejpeg_scaled
    except ImportError:
        print("simplejpeg not installed: skipped (pip install simplejpeg to compare)")
    best = {name: float("inf") for name in candidates}
    for _ in range(repeats):  # interleaved: load changes hit every candidate alike
        for name, fn in candidates.items():
            start = time.perf_counter()
            for blob in blobs:
                fn(blob, size)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: len(blobs) / s for name, s in best.items()}


# ---- 2. decode + augment ---------------------------------------------------------------------


def pil_loop(files, size: int, seed: int) -> float:
    """torchvision-style: per image, full decode, RandomResizedCrop on the PIL image, flip, array."""
    from PIL import Image

    import augment
    op = augment.RandomResizedCrop()
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    out = np.empty((len(files), 3, size, size), np.uint8)
    for i, path in enumerate(files):
        image = Image.open(path).convert("RGB")
        w, h = image.size
        params = op.sample(rng, 1)
        top, left, bh, bw = (int(v[0]) for v in op.boxes(params, h, w))
        image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + bw, top + bh))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(image).transpose(2, 0, 1)
    return len(files) / (time.perf_counter() - start)


def epoch_config(folder: str, a, cache: str):
    from pipeline import Config
    return Config().replace(**{
        "data.source": folder, "data.image_size": a.image_size, "data.cache": cache,
        "data.decode_chunk": 32, "model.name": "small-cnn", "train.strategy": "single",
        "train.replicas": 1, "train.batch_size": 64, "train.lr": 0.01, "train.epochs": 2,
        "average.mix_every": "4", "augment.policy": "resized-crop", "augment.prefetch": 2,
        "seed": a.seed, "progress": False, "checkpoint_every": 0, "eval_every": 0,
        "model.cpu_kernels": a.cpu_kernels})


def loading_alone(client, cfg, resources: dict | None, epochs: float = 1.0,
                  dataset=None) -> tuple:
    """(seconds, images) of ``epochs`` of a run's decode- and augment- tasks (every round's
    shard, as `RoundGraph.submit_augment` submits them; no training); they ask for
    ``resources`` as in a run (the loader workers' ``CPU``). Every call builds a graph with keys
    of its own. ``dataset``: ``cfg``'s, already listed and scanned (default: load it)."""
    from distributed import wait

    from pipeline.training import graph
    from pipeline.training import strategies
    from pipeline.data.datasets import load_dataset
    from pipeline.core.schedule import shard_positions
    ds = dataset if dataset is not None else load_dataset(cfg.data.source, cfg.data)
    data = graph.persist_dataset(client, ds, resources=resources)
    assert data.stream is not None, "expected the uncached path"
    wait(data.test_images)
    g = graph.RoundGraph(client, data, cfg, n_classes=ds.n_classes, device="@numpy",
                         train_resources=None, augment_resources=resources)
    t = cfg.train
    rounds, _, _ = strategies.get(t.strategy).plan(cfg.replace(**{"train.epochs": epochs}),
                                                   data.n_train)
    start = time.perf_counter()
    futures = [g.submit_augment(r, k, t.replicas, t.batch_size) for r in rounds
               for k in range(t.replicas)]
    wait(futures)
    seconds = time.perf_counter() - start
    del futures
    return seconds, sum(len(shard_positions(r, k, t.replicas, t.batch_size)) for r in rounds
                        for k in range(t.replicas))


def decode_augment(folder: str, files: list, a) -> tuple:
    """(PIL loop images/s, {workers: our images/s}, {workers: seconds of each repeat}) of
    decode + augment.

    Ours is what an uncached run loads: every round's decode- and augment- tasks for
    ``--graph-epochs`` epochs (`loading_alone`), on one one-thread worker process and on two. As
    a run places them, the workers advertise CPU and the tasks ask for ``augment.resource``
    (``--no-resources``: plain workers). Several epochs in one stream, as a run decodes them:
    when the stream ends, the last round's augment- waits for its pieces on both workers (up
    to one piece of idle, ~5% of a one-epoch stream on two workers), which a run pays once,
    not every epoch. The clusters alternate, 1, 2, 1, 2, ..., each warmed up by a tenth of an
    epoch, so a change in the machine's speed during the run hits both alike; best of
    ``--repeats``.
    """
    from pipeline.data.datasets import load_dataset
    loop = pil_loop(files[:600], a.image_size, a.seed)
    res = None if a.no_resources else {"CPU": 1}
    cfg = epoch_config(folder, a, "off").replace(**{
        "data.decode_chunk": a.decode_chunk, "train.batch_size": a.batch_size})
    dataset = load_dataset(folder, cfg.data)  # listed and scanned once, for every cluster
    seconds, images = {1: [], 2: []}, 0
    for _ in range(a.repeats):
        for workers in (1, 2):
            with local_client(workers, 1, resources=res) as client:
                loading_alone(client, cfg, res, 0.1, dataset)  # warm-up: imports, first tasks
                took, images = loading_alone(client, cfg, res, a.graph_epochs, dataset)
                seconds[workers].append(took)
    graph = {w: images / min(s) for w, s in seconds.items()}
    took = {w: [round(x, 2) for x in s] for w, s in seconds.items()}
    print(f"decode+augment: PIL loop {loop:.0f}, ours 1 worker {graph[1]:.0f}, 2 workers "
          f"{graph[2]:.0f} images/s; 2w/1w = {graph[2] / graph[1]:.2f} (goal >= 1.8); seconds "
          f"for {a.graph_epochs:g} epochs 1w {took[1]}, 2w {took[2]}")
    return loop, graph, seconds


# ---- 3. an epoch where loading dominates -----------------------------------------------------


def second_epoch_seconds(history) -> float:
    ends = {line["epoch"]: line["seconds"] for line in history}
    return ends[1] - ends[0]


@contextlib.contextmanager
def epoch_cluster(loaders: bool):
    """The epoch part's cluster on two cores: one one-thread training worker and one one-thread
    loader (``--loader-workers 1``, the machine split as a GPU box's is: training on its device,
    loading on CPU cores), or the former one worker process with two threads that share both."""
    from pipeline.cluster.connection import connect
    from pipeline.core.config import ClusterConfig
    split = {"loader_workers": 1} if loaders else {"threads_per_worker": 2}
    with connect(ClusterConfig(workers=1, dashboard_address="127.0.0.1:0", **split),
                 log=lambda m: None) as client:
        yield client


def epoch_seconds(folder: str, a, loaders: bool = True) -> dict:
    """Second-epoch seconds: training alone (cached), loading alone, the pipeline decoding
    every round (see `epoch_cluster`)."""
    from pipeline import train
    with epoch_cluster(loaders) as client:
        quiet = dict(client=client, log=lambda m: None)
        train(epoch_config(folder, a, "on").replace(**{"train.epochs": 0.2}), **quiet)  # warm-up
        cached = train(epoch_config(folder, a, "on"), **quiet)
        load_s, _ = loading_alone(client, epoch_config(folder, a, "off"), {"CPU": 1})
        streamed = train(epoch_config(folder, a, "off"), **quiet)
    out = {"train_alone": second_epoch_seconds(cached.history), "loading_alone": load_s,
           "pipeline": second_epoch_seconds(streamed.history)}
    how = "1 trainer + 1 loader" if loaders else "1 worker x 2 threads"
    print(f"epoch of small-cnn at {a.image_size}px, {how}: train alone {out['train_alone']:.2f} "
          f"s, loading alone {load_s:.2f} s, decoding every round {out['pipeline']:.2f} s; epoch "
          f"/ max = {out['pipeline'] / max(out['train_alone'], load_s):.3f}"
          + (" (goal <= 1.1)" if loaders else ""))
    return out


def _r(value: float, digits: int):
    """Rounded, or None for a part that was not run (JSON has no NaN)."""
    return None if value != value else round(value, digits)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2400)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-resources", action="store_true",
                   help="graph part on plain workers, the tasks asking for no resources")
    p.add_argument("--decode-chunk", type=int, default=128,
                   help="the graph part's data.decode_chunk: most images per decode- task "
                        "(default: the product's)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="the graph part's images per round (each round's shard is decoded by "
                        "its own decode- tasks)")
    p.add_argument("--graph-epochs", type=float, default=3.0,
                   help="epochs of loading the graph part streams per measurement")
    p.add_argument("--keep", default=None, help="write (or reuse) the folder here, not a temp dir")
    p.add_argument("--cpu-kernels", default="ours", choices=["ours", "chainer"],
                   help="the epoch part's convolution/pooling on CPU: ours or Chainer's")
    p.add_argument("--parts", default="decoders,graph,epoch,epoch-shared",
                   help="which measurements to run (epoch: 1 trainer + 1 loader; epoch-shared: "
                        "1 worker x 2 threads, for comparison)")
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    nan = float("nan")
    rates, loop, graph, ratio, graph_s = {}, nan, {1: nan, 2: nan}, nan, {1: [], 2: []}
    epoch = shared = {"train_alone": nan, "loading_alone": nan, "pipeline": nan}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep or tmp) / "jpegs"
        if not root.exists():
            start = time.perf_counter()
            write_jpegs(root, a.images, seed=a.seed)
            print(f"wrote {a.images} JPEGs in {time.perf_counter() - start:.0f} s: {root}")
        folder = str(root)
        files = sorted(str(x) for x in root.glob("*/*.jpg"))

        if "decoders" in parts:
            rates = decoders(files[:240], a.image_size, a.repeats)
            for name, rate in rates.items():
                print(f"decoder {name:14} {rate:8.0f} images/s (one process)")
        if "graph" in parts:
            loop, graph, graph_s = decode_augment(folder, files, a)
            ratio = graph[2] / graph[1]
        if "epoch" in parts:
            epoch = epoch_seconds(folder, a, loaders=True)
        if "epoch-shared" in parts:
            shared = epoch_seconds(folder, a, loaders=False)

    def over_max(e):
        return e["pipeline"] / max(e["train_alone"], e["loading_alone"])

    emit({"bench": "decode", "decode_2w_over_1w": _r(ratio, 3),
          "epoch_over_max": _r(over_max(epoch), 3),
          "loading_over_train": _r(epoch["loading_alone"] / epoch["train_alone"], 3),
          "decoder_images_per_s": {k: _r(v, 1) for k, v in rates.items()},
          "pil_loop_images_per_s": _r(loop, 1),
          "graph_images_per_s": {f"{k}w": _r(v, 1) for k, v in graph.items()},
          "graph_1w_over_pil_loop": _r(graph[1] / loop, 3),
          "graph_seconds": {f"{k}w": [_r(x, 3) for x in v] for k, v in graph_s.items()},
          "graph_batch_size": a.batch_size, "graph_epochs": a.graph_epochs,
          "decode_chunk": a.decode_chunk,
          "epoch_seconds": {k: _r(v, 3) for k, v in epoch.items()},
          "epoch_over_max_shared_2_threads": _r(over_max(shared), 3),
          "epoch_seconds_shared_2_threads": {k: _r(v, 3) for k, v in shared.items()},
          "parts": sorted(parts), "images": a.images, "image_size": a.image_size,
          "goals": {"decode_2w_over_1w": 1.8, "epoch_over_max": 1.1}})


if __name__ == "__main__":
    main()
