"""Small image folders and file lists for the tests, written with Pillow (no shared data needed).

Each class has a learnable signal: class c's images are dominated by hue c (red, green, blue,
...) with seeded noise and a random bright square, in mixed sizes and aspect ratios.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

HUES = np.array([[200, 40, 40], [40, 180, 60], [50, 70, 210], [200, 190, 40]], np.float64)


def photo(label: int, rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8 with class ``label``'s colour, noise and a bright square."""
    base = HUES[label % len(HUES)] * rng.uniform(0.7, 1.1)
    image = base + rng.normal(0, 25, (height, width, 3))
    side = max(2, min(width, height) // 4)
    y, x = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
    image[y:y + side, x:x + side] = 245
    return np.clip(image, 0, 255).astype(np.uint8)


SIZES = ((48, 40), (40, 56), (72, 64), (64, 64), (90, 60))


def write_folder(root: Path, classes: int = 2, per_class: int = 12, seed: int = 0,
                 fmt: str = "JPEG", sizes=SIZES) -> Path:
    """``root/class_<c>/img_<i>.jpg`` (or .png), ``per_class`` images of mixed sizes per class."""
    rng = np.random.default_rng(seed)
    ext = {"JPEG": "jpg", "PNG": "png"}[fmt]
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = sizes[(i + c) % len(sizes)]
            Image.fromarray(photo(c, rng, w, h)).save(folder / f"img_{i:03d}.{ext}", fmt,
                                                      **({"quality": 90} if fmt == "JPEG" else {}))
    return root


def write_split_folder(root: Path, classes: int = 2, train: int = 12, val: int = 4,
                       seed: int = 0) -> Path:
    """``root/train/<class>/...`` and ``root/val/<class>/...``."""
    write_folder(root / "train", classes, train, seed)
    write_folder(root / "val", classes, val, seed + 1)
    return root


def write_list(path: Path, root: Path, entries) -> Path:
    """A file list of ``(relative path, label)`` lines."""
    path.write_text("".join(f"{p} {label}\n" for p, label in entries))
    return path


def png16(path: Path, pixels: np.ndarray) -> Path:
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit RGB): (H, W) grey or (H, W, 3)."""
    height, width = pixels.shape[:2]
    colour = 2 if pixels.ndim == 3 else 0
    rows = pixels.astype(">u2").reshape(height, -1).tobytes()
    stride = len(rows) // height
    raw = b"".join(b"\0" + rows[i * stride:(i + 1) * stride] for i in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
                     chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG that declares ``width`` x ``height`` pixels and holds almost no data (a bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
                     chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return path


def write_tiny_imagenet(root: Path, classes: int = 3, train: int = 6, val: int = 2,
                        seed: int = 0) -> Path:
    """A Tiny-ImageNet-200-shaped folder as it ships (64x64 JPEGs), with the clutter of a real
    copy: ``wnids.txt``, ``words.txt``, ``train/<wnid>/images/<wnid>_<i>.JPEG`` beside
    ``train/<wnid>/<wnid>_boxes.txt``, ``.DS_Store`` files, a macOS ``._`` file and a hidden
    folder, ``val/images/val_<i>.JPEG`` with ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>x0
    <TAB>y0<TAB>x1<TAB>y1``) and an unlabelled ``test/images/``."""
    rng = np.random.default_rng(seed)
    wnids = [f"n0{1443537 + 1000 * c}" for c in range(classes)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("".join(w + "\n" for w in wnids))
    (root / "words.txt").write_text("".join(f"{w}\tthing {c}\n" for c, w in enumerate(wnids)))
    ds_store = b"\0\0\0\1Bud1" + bytes(32)
    (root / "train").mkdir()
    (root / "train" / ".DS_Store").write_bytes(ds_store)
    for c, wnid in enumerate(wnids):
        images = root / "train" / wnid / "images"
        images.mkdir(parents=True)
        boxes = []
        for i in range(train):
            name = f"{wnid}_{i}.JPEG"
            Image.fromarray(photo(c, rng, 64, 64)).save(images / name, "JPEG", quality=90)
            boxes.append(f"{name}\t{i}\t{i}\t{40 + i}\t{40 + i}\n")
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("".join(boxes))
        (root / "train" / wnid / ".DS_Store").write_bytes(ds_store)
    (root / "train" / wnids[0] / "images" / f"._{wnids[0]}_0.JPEG").write_bytes(b"\0\5\26\7")
    (root / "train" / wnids[0] / ".ipynb_checkpoints").mkdir()
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for i in range(val * classes):
        c = (i * 7) % classes  # classes interleaved, as in the real file
        Image.fromarray(photo(c, rng, 64, 64)).save(root / "val" / "images" / f"val_{i}.JPEG",
                                                    "JPEG", quality=90)
        lines.append(f"val_{i}.JPEG\t{wnids[c]}\t0\t1\t62\t63\n")
    (root / "val" / "val_annotations.txt").write_text("".join(lines))
    (root / "test" / "images").mkdir(parents=True)
    Image.fromarray(photo(0, rng, 64, 64)).save(root / "test" / "images" / "test_0.JPEG", "JPEG")
    return root
