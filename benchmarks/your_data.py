"""Benchmark: your data as it is (issue 24): a Tiny-ImageNet-scale folder of 64x64 JPEGs, and the
same images trained from a Dask array and from CIFAR files.

1. ``folder``: writes a Tiny-ImageNet-200-shaped folder (``--classes`` x ``--per-class`` 64x64
   JPEGs in ``train/<wnid>/images/``, a ``<wnid>_boxes.txt`` and a ``.DS_Store`` in each class)
   unless ``--keep`` holds one, then measures the scan (listing + the scan- tasks that check
   every file, on 2 one-thread worker processes) and decode + augment images/s (an uncached
   run's decode- and augment- tasks, resized-crop + flip, ``--sample`` images of the epoch) on
   1 and 2 workers, against the torchvision-style per-image loop (PIL open + convert, random
   resized crop, flip, to array: what ``ImageFolder`` + ``RandomResizedCrop`` +
   ``RandomHorizontalFlip`` + ``PILToTensor`` do per image) in 1 process and in a pool of 2
   (``DataLoader(num_workers=2)``'s shape). torchvision itself is not run: PyPI's torch wheel
   for Linux x86_64 is the CUDA build (~0.9 GB plus ~2.5 GB of nvidia-* wheels); CPU-only
   wheels are on PyTorch's own index, which this workplace does not reach.
2. ``arrays``: ``--train`` synthetic images written as CIFAR python files, trained (small-cnn,
   ``single``, ``--epochs`` 3, 2 one-thread workers) from the files and from the same images as
   Dask arrays (``train(config, data=...)``); images/s of the epochs after the first,
   alternated, best of ``--repeats``. The weights are the same bits (tests/data/test_arrays.py); only time may differ.

    flock /work/cpu.lock .venv/bin/python benchmarks/your_data.py     # ~10 min on 2 cores
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import emit, local_client  # noqa: I001
from decode import loading_alone, pil_loop


# ---- 1. a Tiny-ImageNet-scale folder ---------------------------------------------------------


def write_tiny(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    """``root/train/<wnid>/images/<wnid>_<i>.JPEG`` (64x64, quality 90) with the clutter of a
    real copy; returns ``root/train``."""
    from PIL import Image
    train = root / "train"
    if (train / "done").exists():
        return train
    rng = np.random.default_rng(seed)
    for c in range(classes):
        wnid = f"n{c:08d}"
        images = train / wnid / "images"
        images.mkdir(parents=True, exist_ok=True)
        hue = rng.uniform(40, 215, 3)
        for i in range(per_class):
            smooth = rng.normal(0, 1, (6, 6, 3)).cumsum(0).cumsum(1) * 12
            big = np.kron(smooth, np.ones((11, 11, 1)))[:64, :64]
            pixels = np.clip(hue + big + rng.normal(0, 12, (64, 64, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(images / f"{wnid}_{i}.JPEG", "JPEG", quality=90)
        (train / wnid / f"{wnid}_boxes.txt").write_text(
            "".join(f"{wnid}_{i}.JPEG\t0\t0\t63\t63\n" for i in range(per_class)))
        (train / wnid / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (train / "done").write_text("")
    return train


def _pil_part(args) -> int:
    files, size, seed = args
    pil_loop(files, size, seed)
    return len(files)


def pil_pool(files: list, size: int, seed: int, procs: int) -> float:
    """images/s of the torchvision-style loop split over ``procs`` processes (pool started and
    warmed before the clock, as a DataLoader's workers are once the first epoch runs)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(procs) as pool:
        pool.map(_pil_part, [(files[:20], size, seed)] * procs)
        parts = [(files[i::procs], size, seed + i) for i in range(procs)]
        start = time.perf_counter()
        done = sum(pool.map(_pil_part, parts))
        return done / (time.perf_counter() - start)


def folder_part(a) -> dict:
    from pipeline import Config
    from pipeline.data.datasets import load_dataset
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="tiny-"))
    start = time.perf_counter()
    train = write_tiny(root, a.classes, a.per_class, a.seed)
    wrote = time.perf_counter() - start
    cfg = Config().replace(**{
        "data.source": str(train), "data.image_size": 64, "data.cache": "off",
        "data.decode_chunk": 128, "model.name": "small-cnn", "train.strategy": "single",
        "train.replicas": 1, "train.batch_size": 128, "augment.policy": "resized-crop",
        "seed": a.seed, "progress": False, "checkpoint_every": 0, "eval_every": 0})
    with local_client(2, 1) as client:
        start = time.perf_counter()
        dataset = load_dataset(str(train), cfg.data, client=client)
        scan = time.perf_counter() - start
    n = int(dataset.train_images.shape[0]) + int(dataset.test_images.shape[0])
    files = sorted(str(p) for p in train.glob("*/images/*.JPEG"))
    sample = np.random.default_rng(0).permutation(len(files))[:a.sample]
    picked = [files[i] for i in sample]
    epochs = a.sample / int(dataset.train_images.shape[0])
    ours, res = {1: [], 2: []}, {"CPU": 1}
    loop = {1: [], 2: []}
    for _ in range(a.repeats):
        loop[1].append(pil_loop(picked[:a.sample // 4], 64, a.seed))
        loop[2].append(pil_pool(picked, 64, a.seed, 2))
        for workers in (1, 2):
            with local_client(workers, 1, resources=res) as client:
                loading_alone(client, cfg, res, epochs / 10, dataset)  # warm-up
                took, images = loading_alone(client, cfg, res, epochs, dataset)
                ours[workers].append(images / took)
    best = {k: max(v) for k, v in ours.items()}
    base = {k: max(v) for k, v in loop.items()}
    print(f"folder: {n} images ({a.classes} classes) written in {wrote:.0f} s, listed + scanned "
          f"in {scan:.1f} s ({n / scan:.0f} files/s on 2 workers); decode+augment images/s: "
          f"ours 1w {best[1]:.0f}, 2w {best[2]:.0f}; torchvision-style PIL loop 1 process "
          f"{base[1]:.0f}, pool of 2 {base[2]:.0f}; all repeats ours {ours}, loop {loop}")
    return {"files": n, "scan_s": round(scan, 1), "scan_files_per_s": round(n / scan),
            "ours_1w": round(best[1]), "ours_2w": round(best[2]),
            "pil_loop_1p": round(base[1]), "pil_loop_2p": round(base[2]),
            "ours_2w_over_pil_2p": round(best[2] / base[2], 2)}


# ---- 2. Dask arrays vs CIFAR files -----------------------------------------------------------


def arrays_part(a) -> dict:
    import dask.array as da

    from pipeline import Config, train
    from pipeline.data.cifar import write_synthetic
    from pipeline.data.datasets import dataset_arrays, load_dataset
    path = write_synthetic(tempfile.mkdtemp(prefix="cifar-"), a.train, 1000, seed=0)
    x, y, tx, ty = dataset_arrays(load_dataset(path))
    cfg = Config().replace(**{
        "data.source": path, "model.name": "small-cnn", "train.strategy": "single",
        "train.replicas": 1, "train.batch_size": 64, "train.epochs": a.epochs, "seed": 0,
        "augment.policy": "cifar", "progress": False, "checkpoint_every": 0, "eval_every": 0})
    rates = {"cifar": [], "arrays": []}
    for _ in range(a.repeats):
        for kind in ("cifar", "arrays"):
            data = (da.from_array(x, chunks=(a.chunk, 3, 32, 32)), y, tx, ty) \
                if kind == "arrays" else None
            with local_client(2, 1) as client:
                result = train(cfg, client, data=data, log=lambda m: None)
            rates[kind].append(after_first_epoch(result.history, a.train))
    best = {k: max(v) for k, v in rates.items()}
    print(f"training images/s (epochs 2..{a.epochs}, small-cnn, 2 workers): CIFAR files {best['cifar']:.0f}, "
          f"Dask arrays {best['arrays']:.0f}; repeats {rates}")
    return {"train_cifar_images_per_s": round(best["cifar"]),
            "train_arrays_images_per_s": round(best["arrays"]),
            "arrays_over_cifar": round(best["arrays"] / best["cifar"], 3)}


def after_first_epoch(history: list, n_train: int) -> float:
    """images/s from the first round at or past epoch 1 to the last round."""
    first = next(h for h in history if h["epoch"] >= 1 - 1e-9)
    last = history[-1]
    return (last["epoch"] - first["epoch"]) * n_train / (last["seconds"] - first["seconds"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=200)
    p.add_argument("--per-class", type=int, default=500)
    p.add_argument("--sample", type=int, default=8000, help="images decoded+augmented per repeat")
    p.add_argument("--train", type=int, default=10000, help="part 2: training images")
    p.add_argument("--epochs", type=int, default=3, help="part 2: epochs (the first not timed)")
    p.add_argument("--chunk", type=int, default=2000, help="part 2: rows per Dask array block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", default=None, help="write (or reuse) the folder here")
    p.add_argument("--parts", default="folder,arrays")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    figures = {"bench": "your_data"}
    if "folder" in a.parts:
        figures.update(folder_part(a))
    if "arrays" in a.parts:
        figures.update(arrays_part(a))
    emit(figures)


if __name__ == "__main__":
    main()
