"""The reader seam: what a dataset reader hands the graph builder, the registry entry type, and
the ``Shard`` of data a replica trains on in one round.

A reader turns a ``--data`` source into a :class:`Plan`: the chunks of each split (each with its
image count ``n``), the class names, what the data is (``ident``, for the task tokens) and the
task body that reads one chunk on a worker. ``pipeline.data.datasets`` tries the registered readers in
order (arrays given from Python, synthetic, file list, image folder, CIFAR) and builds the same kind of graph from any of
them, so CIFAR python, CIFAR binary, image folders and file lists are peers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from pipeline.core.config_data import MAX_CLASSES
from pipeline.core.errors import DataError

# Class names as every reader gives them and OUT/data.json records them: predict reads that
# file with room for these many characters (pipeline.training.predict), so whatever a run
# writes its own predict reads back. 255: a folder name's limit on common file systems.
MAX_NAME_CHARS = 255
MAX_NAMES_CHARS = 1 << 22  # all class names together: 42 a class on average at MAX_CLASSES
NAMES_JSON_BYTES = 6 * MAX_NAMES_CHARS + 8 * MAX_CLASSES  # their most in data.json: a
#                    character escaped to 6 bytes (\udcXX), 8 bytes of JSON around each name

if TYPE_CHECKING:
    from pipeline.data.images import Stream


class Plan(NamedTuple):
    """Where every chunk comes from and what it holds, known before any task runs."""
    train: tuple  # chunks (each with .n images) of the training split
    test: tuple  # chunks of the test / val split
    label_names: tuple  # class index -> name
    class_counts_train: tuple  # training images per class
    ident: tuple  # what the data is; the task tokens derive from it
    source: str  # what was loaded, for messages and Dataset.source
    read: Callable  # task body: chunk -> ((n, *image_shape) uint8, (n,) int32)
    stage: str = "load"  # key prefix of the read tasks: "load" (CIFAR) or "decode" (images)
    image_shape: tuple = (3, 32, 32)  # (C, H, W) of one image
    info: dict | None = None  # extra fields for `inspect` (formats, sizes seen, ...)
    stream: Stream | None = None  # image sources: what decoding the training split again each epoch
    #                        needs (pipeline.data.images.Stream); None for in-memory sources
    arrays: tuple | None = None  # data that is an array already (pipeline.data.arrays): the
    #                              dataset's (images, labels, test images, test labels) dask arrays;
    #                              ``read`` is then unused


def check_class_names(names: tuple, where: str) -> tuple:
    """``names`` when at most ``MAX_CLASSES`` of at most ``MAX_NAME_CHARS`` characters each and
    ``MAX_NAMES_CHARS`` in all; DataError naming the first too long.

    >>> check_class_names(("a", "b" * 300), "x.txt")
    Traceback (most recent call last):
    ...
    pipeline.core.errors.DataError: x.txt: class 1's name is 300 characters ('bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb...'); at most 255
    """
    if len(names) > MAX_CLASSES:
        raise DataError(f"{where}: {len(names)} classes; at most {MAX_CLASSES} "
                        "(model.n_classes' limit)")
    for i, name in enumerate(names):
        if len(name) > MAX_NAME_CHARS:
            raise DataError(f"{where}: class {i}'s name is {len(name)} characters "
                            f"({name[:40] + '...'!r}); at most {MAX_NAME_CHARS}")
    total = sum(len(n) for n in names)
    if total > MAX_NAMES_CHARS:
        raise DataError(f"{where}: the {len(names)} class names hold {total} characters; at "
                        f"most {MAX_NAMES_CHARS} in all")
    return names


def checked(plan: Plan) -> Plan:
    """``plan`` whose class names pass :func:`check_class_names` (every reader's)."""
    check_class_names(tuple(plan.label_names), str(plan.source)[:200])
    return plan


class Shard(NamedTuple):
    """One replica's data for one round: ``images`` (n, 3, 32, 32) uint8 (augmented),
    ``labels`` (n,) int32."""
    images: np.ndarray
    labels: np.ndarray


class Reader(NamedTuple):
    """A registry entry: ``claims(source, cfg)`` says whether it reads ``source``;
    ``plan(source, cfg, download, client)`` lists and checks it (DataError when bad)."""
    name: str
    claims: Callable
    plan: Callable
    checks_on_driver: bool  # True: plan reads and checks every file itself, so a run loads the
    #                         data before a cluster starts; False: files are checked in scan-
    #                         tasks on the workers (plan needs the client)
    image_side: int | None = None  # the side of every image when the format fixes it (CIFAR:
    #                                32); None: resized to data.image_size
    # The facts a run records and reads back (config.json's data.dataset, OUT/data.json); every
    # list of them elsewhere is derived from READERS (pipeline.data.datasets.KINDS, facts).
    kinds: tuple = ()  # what config.json's data.dataset records for this reader's data; () : name
    eval_split: str = "test"  # the split it evaluates on: "val" where held out of the images
    image_files: bool = False  # made of image files: evaluation and predict read a centre crop
    #                            resized to the run's size (pipeline.data.imagefolder.EVAL_CROP)
    refindable: bool = True  # config.json's data.source finds the data again (False: arrays held
    #                          in memory; a run keeps its evaluation split, EVAL_FILE)

    def recorded(self) -> tuple:
        """The kinds this reader's runs record in ``data.dataset``."""
        return self.kinds or (self.name,)
