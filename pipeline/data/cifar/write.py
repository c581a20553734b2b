"""Writing the official CIFAR layouts (directory and reproducible ``.tar.gz``) from arrays."""
from __future__ import annotations

import gzip
import io
import os
import tarfile

import numpy as np

from pipeline.core.errors import DataError
from pipeline.core.files import os_reason
from pipeline.data.cifar.layout import IMAGE_BYTES, LAYOUTS, Layout
from pipeline.data.cifar.py2pickle import py2_dumps


_README = (b'<meta HTTP-EQUIV="REFRESH" content="0; '
           b'url=http://www.cs.toronto.edu/~kriz/cifar.html">\n')
# Member order of the official archives (tarfile lists them so).
_TAR_ORDER = {
    "cifar10-python": ("data_batch_4", "readme.html", "test_batch", "data_batch_3", "batches.meta",
                       "data_batch_2", "data_batch_5", "data_batch_1"),
    "cifar10-binary": ("data_batch_1.bin", "batches.meta.txt", "data_batch_3.bin",
                       "data_batch_4.bin", "test_batch.bin", "readme.html", "data_batch_2.bin",
                       "data_batch_5.bin"),
    "cifar100-python": ("file.txt~", "train", "test", "meta"),
}


def _filenames(labels: np.ndarray, names, start: int) -> list[bytes]:
    return [f"synthetic_{names[c] if 0 <= c < len(names) else c}_s_{start + i:06d}.png".encode()
            for i, c in enumerate(labels)]


def write_python10(out: str, train, test, label_names, tar: bool = False) -> str:
    """Write ``out/cifar-10-batches-py/`` from train ``[(images, labels)] * k`` and a test pair."""
    files, start = {}, 0
    for i, (images, labels) in enumerate(train):
        files[f"data_batch_{i + 1}"] = py2_dumps(_py10_batch(
            f"training batch {i + 1} of {len(train)}", images, labels, label_names, start))
        start += len(labels)
    files["test_batch"] = py2_dumps(_py10_batch("testing batch 1 of 1", *test, label_names, 0))
    files["batches.meta"] = py2_dumps({b"num_cases_per_batch": len(train[0][1]),
                                       b"label_names": [n.encode() for n in label_names],
                                       b"num_vis": IMAGE_BYTES})
    files["readme.html"] = _README
    return _write_layout(out, LAYOUTS["cifar10-python"], files, tar)


def _py10_batch(batch_label, images, labels, names, start) -> dict:
    # Key order as in the official files: batch_label, labels, data, filenames.
    return {b"batch_label": batch_label.encode(), b"labels": [int(c) for c in labels],
            b"data": np.asarray(images).reshape(len(images), IMAGE_BYTES),
            b"filenames": _filenames(labels, names, start)}


def write_binary10(out: str, train, test, label_names, tar: bool = False) -> str:
    """Write ``out/cifar-10-batches-bin/`` (records of 1 label byte + 3072 image bytes)."""
    def records(images, labels):
        flat = np.asarray(images, np.uint8).reshape(len(images), IMAGE_BYTES)
        return np.concatenate([np.asarray(labels, np.uint8)[:, None], flat], axis=1).tobytes()
    files = {f"data_batch_{i + 1}.bin": records(*batch) for i, batch in enumerate(train)}
    files["test_batch.bin"] = records(*test)
    files["batches.meta.txt"] = ("\n".join(label_names) + "\n\n").encode()
    files["readme.html"] = _README
    return _write_layout(out, LAYOUTS["cifar10-binary"], files, tar)


def write_python100(out: str, train, test, fine_names, coarse_names, tar: bool = False) -> str:
    """Write ``out/cifar-100-python/`` from ``(images, fine, coarse)`` for train and test."""
    def batch(label, images, fine, coarse):  # key order as in the official files
        return py2_dumps({b"filenames": _filenames(fine, fine_names, 0), b"batch_label": label,
                          b"fine_labels": [int(c) for c in fine],
                          b"coarse_labels": [int(c) for c in coarse],
                          b"data": np.asarray(images).reshape(len(images), IMAGE_BYTES)})
    files = {"train": batch(b"training batch 1 of 1", *train),
             "test": batch(b"testing batch 1 of 1", *test),
             "meta": py2_dumps({b"fine_label_names": [n.encode() for n in fine_names],
                                b"coarse_label_names": [n.encode() for n in coarse_names]}),
             "file.txt~": b""}
    return _write_layout(out, LAYOUTS["cifar100-python"], files, tar)


def _write_layout(out: str, lay: Layout, files: dict[str, bytes], tar: bool) -> str:
    """Write the files of ``lay`` under ``out``; never over an existing file (a real CIFAR
    copy or the cached official archive could sit there): DataError naming it instead."""
    directory = os.path.join(out, lay.top)
    targets = [os.path.join(directory, name) for name in files]
    targets += [os.path.join(out, lay.archive)] if tar else []
    present = next((t for t in targets if os.path.lexists(t)), None)
    if present is not None:
        raise DataError(f"{present}: already exists; writing a dataset never replaces files "
                        "(pick another --out)")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        if tar:
            write_tar(os.path.join(out, lay.archive), lay.top,
                      [(name, files[name]) for name in _TAR_ORDER[lay.key]])
    except OSError as exc:
        raise DataError(f"{out}: cannot write the dataset ({os_reason(exc)})") from None
    return directory


def write_tar(path: str, top: str, members: list[tuple[str, bytes]]) -> None:
    """A reproducible ``.tar.gz`` of ``top/`` and its ``(name, bytes)`` members, in that order."""
    def info(name, size, is_dir=False):
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode = size, 0, 0o755 if is_dir else 0o644
        ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
        return ti
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="",
                                        compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.addfile(info(top, 0, is_dir=True))
        for name, data in members:
            tf.addfile(info(f"{top}/{name}", len(data)), io.BytesIO(data))
