"""Builds each round's tasks on the cluster: (decode-,) augment-, train-, average-, update-, evaluate- keys.

The only training module that talks to distributed. Keys are ``("<stage>-<run token>", round,
replica, ...)``: the dashboard groups by the stage, the tuple says where in the run a task sits.
Each stage is submitted inside a ``distributed.span`` of its name, so the dashboard's fine
performance metrics split time by stage too.
"""
from __future__ import annotations

import contextlib
import uuid
from typing import NamedTuple

import distributed
import numpy as np

import augment as aug
from pipeline import averaging, tasks
from pipeline.reduction import tree_reduce
from pipeline.schedule import Round, epoch_permutation, shard_positions


def augment(image_blocks: list, label_blocks: list, starts: tuple, indices: np.ndarray,
            positions: np.ndarray, policy: str, seed: int, epoch: int, chunk: int) -> tasks.Shard:
    """Gather one replica's shard from the raw blocks and augment it.

    ``indices`` are dataset rows, ``positions`` their places in the epoch's order: the augment
    parameters of position p come from ``rng_for(seed, "augment", epoch, p // chunk)``, so a
    sample's augmentation does not depend on how positions are split among replicas and rounds.
    Returns uint8 (n, 3, H, W) images and int32 labels.
    """
    from pipeline.rng import rng_for
    first = image_blocks[0]
    images = np.empty((len(indices),) + first.shape[1:], dtype=first.dtype)
    labels = np.empty(len(indices), dtype=np.int32)
    ends = tuple(starts[1:]) + (starts[-1] + len(image_blocks[-1]),)
    for block_images, block_labels, lo, hi in zip(image_blocks, label_blocks, starts, ends):
        mask = (indices >= lo) & (indices < hi)
        if mask.any():
            images[mask] = block_images[indices[mask] - lo]
            labels[mask] = block_labels[indices[mask] - lo]
    compose = aug.get_policy(policy)
    params = aug.sample_for_positions(compose, lambda j: rng_for(seed, "augment", epoch, j),
                                      positions, chunk)
    return tasks.Shard(compose.apply(images, params), labels)


def pick(result, field: int):
    """One field of a task's tuple result, as its own key so consumers fetch only that part."""
    return result[field]


def average_outer(previous: dict, mean: dict, momentum_buf: dict | None, lr: float,
                  momentum: float) -> tuple:
    """The outer optimizer step on the replicas' mean (DiLoCo's outer Nesterov momentum).

    Returns ``(params, momentum_buffer)``; averaged optimizer state ("opt/...") passes through.
    """
    params = {k: v for k, v in mean.items() if not k.startswith("opt/")}
    new, buf = averaging.outer_step({k: previous[k] for k in params}, params, momentum_buf, lr,
                                    momentum)
    new.update({k: v for k, v in mean.items() if k.startswith("opt/")})
    return new, buf


def _average_leaf(payload: dict):
    return averaging.leaf(payload, 1)


class Persisted(NamedTuple):
    """The dataset, loaded once and kept on the cluster as one future per block."""
    train_images: list  # [] when the training images are decoded again each round (stream)
    train_labels: list
    train_starts: tuple
    test_images: list
    test_labels: list
    n_train: int
    stream: object = None  # image_readers.Stream when the training set is not cached, else None
    note: str = ""  # one line for the run's log: what the cache holds, or why it is off


def persist_dataset(client: distributed.Client, dataset, eval_chunk: int = 250) -> Persisted:
    """Load the raw data onto the cluster once (``load-``/``decode-`` tasks); consumers refer to
    it by key. Decoded image folders too, unless they do not fit (`image_readers.cache_decision`):
    then only the test split is kept and each round decodes its own shards."""
    from pipeline import image_readers
    test_images = dataset.test_images.rechunk({0: eval_chunk})
    test_labels = dataset.test_labels.rechunk({0: eval_chunk})
    stream, note, n_train = dataset.stream, "", int(dataset.train_images.shape[0])
    if stream is not None:
        cached, note = image_readers.cache_decision(
            stream, n_train, image_readers.worker_memory_limits(client))
        stream = None if cached else stream
    train = [] if stream is not None else [dataset.train_images, dataset.train_labels]
    with distributed.span("load"):
        arrays = client.persist(train + [test_images, test_labels])

    def blocks(array):
        by_key = {f.key: f for f in distributed.futures_of(array)}
        return [by_key[k] for k in _block_keys(array)]

    test = [blocks(a) for a in arrays[-2:]]
    if stream is not None:
        return Persisted([], [], (), *test, n_train, stream, note)
    starts = tuple(int(s) for s in np.cumsum((0,) + dataset.train_images.chunks[0][:-1]))
    return Persisted(blocks(arrays[0]), blocks(arrays[1]), starts, *test, n_train, None, note)


def _block_keys(array) -> list:
    keys = array.__dask_keys__()
    while isinstance(keys, list) and keys and isinstance(keys[0], list):
        keys = [k[0] if isinstance(k, list) else k for k in keys]
    return keys


class RoundGraph:
    """Submits the tasks of one run, round by round, with stage-named keys and resources."""

    def __init__(self, client: distributed.Client, data: Persisted, config, *, n_classes: int,
                 device: str, train_resources: dict | None, augment_resources: dict | None,
                 token: str | None = None):
        self.client, self.data, self.config = client, data, config
        self.n_classes, self.device = n_classes, device
        self.train_resources, self.augment_resources = train_resources, augment_resources
        self.token = token or uuid.uuid4().hex[:8]
        self._perms: dict[int, np.ndarray] = {}

    def key(self, stage: str, *coords):
        return (f"{stage}-{self.token}", *coords)

    def _submit(self, func, *args, key, resources=None):
        return self.client.submit(func, *args, key=key, pure=False, resources=resources)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: epoch_permutation(self.config.seed, epoch, self.data.n_train)}
        return self._perms[epoch]

    def submit_augment(self, rnd: Round, replica: int, replicas: int, batch_size: int):
        positions = shard_positions(rnd, replica, replicas, batch_size)
        indices = self._perm(rnd.epoch)[positions]
        cfg = self.config
        images, labels, starts = (self.data.train_images, self.data.train_labels,
                                  self.data.train_starts)
        if self.data.stream is not None:  # not cached: decode this shard's files first
            from pipeline.image_readers import submit_decode
            with distributed.span("decode"):
                images, labels, starts = submit_decode(
                    self._submit, self.key, self.data.stream, indices, rnd.index, replica,
                    self.augment_resources)
            indices = np.arange(len(indices))
        with distributed.span("augment"):
            return self._submit(augment, images, labels, starts, indices, positions,
                                cfg.augment.policy,
                                cfg.seed, rnd.epoch, cfg.augment.chunk,
                                key=self.key("augment", rnd.index, replica),
                                resources=self.augment_resources)

    def submit_train(self, rnd: Round, replica: int, params, opt, shard, spec: tasks.StepSpec):
        """Returns futures ``(payload, opt, metrics)`` of the replica's train- task."""
        with distributed.span("train"):
            fut = self._submit(tasks.train, params, opt, shard, spec,
                               key=self.key("train", rnd.index, replica),
                               resources=self.train_resources)
            return tuple(self._submit(pick, fut, i, key=self.key("train", rnd.index, replica, name))
                         for i, name in enumerate(("payload", "opt", "metrics")))

    def _tree_mean(self, rnd: Round, payloads: list):
        """The replicas' mean (float64 sums, divided once at the root, cast back), as a tree of
        ``average-`` tasks grouped in replica order with ``average.fan_in`` children each."""
        return tree_reduce(self.client, payloads, averaging.combine, averaging.finalize,
                           fan_in=self.config.average.fan_in, name="average", token=self.token,
                           coords=(rnd.index,), leaf=_average_leaf,
                           combine_finalize=averaging.combine_finalize)

    def submit_average(self, rnd: Round, payloads: list, previous, momentum_buf):
        """Average the replicas' payloads, then the outer step unless it is plain averaging
        (outer lr 1, momentum 0). Returns futures ``(params, momentum_buffer or None)``."""
        avg = self.config.average
        with distributed.span("average"):
            mean = self._tree_mean(rnd, payloads)
            if avg.outer_lr == 1.0 and avg.outer_momentum == 0.0:
                return mean, None
            fut = self._submit(average_outer, previous, mean, momentum_buf, avg.outer_lr,
                               avg.outer_momentum, key=self.key("average", rnd.index, "outer"))
            return tuple(self._submit(pick, fut, i, key=self.key("average", rnd.index, name))
                         for i, name in enumerate(("params", "momentum")))

    def submit_gradient_update(self, rnd: Round, payloads: list, params, opt,
                               spec: tasks.StepSpec):
        """Average the replicas' gradients in a tree, one optimizer update. Returns (params, opt)."""
        with distributed.span("average"):
            mean = self._tree_mean(rnd, payloads)
        with distributed.span("update"):
            fut = self._submit(tasks.update, params, opt, mean, spec,
                               key=self.key("update", rnd.index), resources=self.train_resources)
            return tuple(self._submit(pick, fut, i, key=self.key("update", rnd.index, name))
                         for i, name in enumerate(("params", "opt")))

    def submit_evaluate(self, rnd_index: int, params, spec: tasks.EvalSpec) -> list:
        with distributed.span("evaluate"):
            return [self._submit(tasks.evaluate, params, images, labels, spec,
                                 key=self.key("evaluate", rnd_index, i),
                                 resources=self.train_resources)
                    for i, (images, labels) in enumerate(zip(self.data.test_images,
                                                             self.data.test_labels))]

    def scatter(self, value):
        """Put a host value on the cluster as a root with no lineage (checkpoints, resumes)."""
        return self.client.scatter([value], hash=False)[0]


@contextlib.contextmanager
def task_stream(client: distributed.Client):
    """Yields a function returning the task-stream records not returned before (stage timing).

    The first call registers the scheduler's task-stream plugin, so it is made on entry. Windows
    overlap by a second (clocks of scheduler and driver differ a little); records are de-duplicated.
    """
    import time
    client.get_task_stream(start=time.time(), stop=time.time())
    mark, seen = [time.time() - 1.0], set()

    def since_last():
        now = time.time()
        records = client.get_task_stream(start=mark[0] - 1.0, stop=now + 1.0)
        mark[0] = now
        fresh = []
        for rec in records:
            ident = (str(rec.get("key")), tuple(ss.get("start") for ss in rec.get("startstops", ())))
            if ident not in seen:
                seen.add(ident)
                fresh.append(rec)
        return fresh

    yield since_last
