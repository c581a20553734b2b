"""The CIFAR file formats: find, read and validate the official batches, write them, draw
synthetic ones. Pure format code (no dask); ``pipeline.data.datasets`` ships :func:`load` to
workers.

Modules, from the bottom up: ``layout`` (files, limits, the values that name a batch),
``archive`` (capped reads of files and tarballs), ``parse`` (restricted unpickler, validation),
``py2pickle`` (Python 2 pickles as the official files), ``write`` (the official layouts),
``synthetic`` (the synthetic CIFAR-10), ``source`` (find and scan a source) and ``task`` (the
``load-`` task).
"""
from pipeline.data.cifar.archive import limit_of, read_archive, read_file
from pipeline.data.cifar.layout import (CIFAR10_LABEL_NAMES, IMAGE_BYTES, IMAGE_SHAPE, LAYOUTS,
                                        MAX_BINARY_BATCH_BYTES, MAX_IMAGES_PER_FILE,
                                        MAX_META_BYTES, MAX_PYTHON_BATCH_BYTES, RECORD_BYTES,
                                        SPLITS, TRAIN_BATCHES, BatchFile, Catalog, Layout,
                                        SyntheticChunk, layout_of_top)
from pipeline.data.cifar.parse import parse_batch, parse_meta, safe_unpickle
from pipeline.data.cifar.py2pickle import py2_dumps
from pipeline.data.cifar.source import locate, scan
from pipeline.data.cifar.synthetic import (render, split_sizes, synthetic_batch,
                                           synthetic_labels, write_synthetic)
from pipeline.data.cifar.task import load
from pipeline.data.cifar.write import write_binary10, write_python10, write_python100, write_tar

__all__ = ("CIFAR10_LABEL_NAMES", "IMAGE_BYTES", "IMAGE_SHAPE", "LAYOUTS",
           "MAX_BINARY_BATCH_BYTES", "MAX_IMAGES_PER_FILE", "MAX_META_BYTES",
           "MAX_PYTHON_BATCH_BYTES", "RECORD_BYTES", "SPLITS", "TRAIN_BATCHES", "BatchFile",
           "Catalog", "Layout", "SyntheticChunk", "layout_of_top", "limit_of",
           "read_archive", "read_file", "parse_batch", "parse_meta", "safe_unpickle", "py2_dumps",
           "locate", "scan", "render", "split_sizes", "synthetic_batch", "synthetic_labels",
           "write_synthetic", "load", "write_binary10", "write_python10", "write_python100",
           "write_tar")
