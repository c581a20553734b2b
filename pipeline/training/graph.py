"""Submits a run's tasks to the cluster: the dataset once (load-), then augment-, train-, average-,
update-, apply-, evaluate- tasks as strategies ask.

The only training module that talks to distributed. Keys come from ``pipeline.core.keys``:
``("<stage>-<run token>", round, replica, ...)``, so the dashboard groups by the stage and the
tuple says where in the run a task sits. Each stage is submitted inside a ``distributed.span``
of its name, so the dashboard's fine performance metrics split time by stage too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import distributed
import numpy as np

from pipeline.averaging import algorithms
from pipeline.core import keys
from pipeline.training import tasks
from pipeline.training.placement import Placement, place
from pipeline.training.tasks import move, pick
from pipeline.data import arrays as data_arrays, datasets
from pipeline.data.augment import augment
from pipeline.core.schedule import Round, epoch_permutation, shard_positions

if TYPE_CHECKING:
    from pipeline.data.images import Stream


class Trained(NamedTuple):
    """Futures of one replica's train- task: its parts, each a small pick task beside it."""
    params: distributed.Future  # the replica's parameters after its steps
    opt: distributed.Future  # its optimizer state
    metrics: distributed.Future  # the metrics dict of its steps
    result: distributed.Future  # the whole ``TrainResult`` (what the picks take apart)


class Persisted(NamedTuple):
    """The dataset, loaded once and kept on the cluster as one future per block."""
    train_images: list  # [] when the training images are decoded again each round (stream)
    train_labels: list
    train_starts: tuple
    test_images: list
    test_labels: list
    n_train: int
    stream: Stream | None = None  # when the training set is not cached, else None
    note: str = ""  # one line for the run's log: what the cache holds, or why it is off


def eval_chunk_size(n_test: int) -> int:
    """Test images per evaluate- task: eight chunks or more, so that an evaluation splits evenly
    over the training workers (``RoundGraph.submit_evaluate``), each at least a forward batch
    (100) and at most 250 images. A function of the test set alone, so the chunks, their
    batches and the order their sums are added in are the same on any number of workers.

    >>> eval_chunk_size(200), eval_chunk_size(1017), eval_chunk_size(2000), eval_chunk_size(10000)
    (100, 128, 250, 250)
    """
    return min(250, max(100, -(-n_test // 8)))


def persist_dataset(client: distributed.Client, dataset, eval_chunk: int | None = None,
                    resources: dict | None = None) -> Persisted:
    """Load the raw data onto the cluster once (``load-``/``decode-`` tasks, asking for
    ``resources``: the loading workers'); consumers refer to it by key. Decoded image folders
    too, unless they do not fit (`pipeline.data.images.cache_decision`): then only the test split is
    kept and each round decodes its own shards. ``eval_chunk``: test images per block
    (default :func:`eval_chunk_size` of the test set's size)."""
    from pipeline.data.images import cache_decision, worker_memory_limits
    eval_chunk = eval_chunk or eval_chunk_size(int(dataset.test_images.shape[0]))
    test_images, test_labels = (datasets.row_blocks(a, eval_chunk)
                                for a in (dataset.test_images, dataset.test_labels))
    stream, note, n_train = dataset.stream, "", int(dataset.train_images.shape[0])
    if stream is not None:
        cached, note = cache_decision(
            stream, n_train, worker_memory_limits(client))
        stream = None if cached else stream
    train = [] if stream is not None else [dataset.train_images, dataset.train_labels]
    with distributed.span("load"), data_arrays.carried(dataset.train_images, test_images):
        arrays = client.persist(train + [test_images, test_labels], resources=resources)

    def blocks(array):
        by_key = {f.key: f for f in distributed.futures_of(array)}
        return [by_key[k] for k in datasets.block_keys(array)]

    test = [blocks(a) for a in arrays[-2:]]
    if stream is not None:
        return Persisted([], [], (), *test, n_train, stream, note)
    starts = tuple(int(s) for s in np.cumsum((0,) + dataset.train_images.chunks[0][:-1]))
    return Persisted(blocks(arrays[0]), blocks(arrays[1]), starts, *test, n_train, None, note)


def data_lost(data: Persisted) -> bool:
    """Whether some persisted block of the dataset is gone for good: its future cancelled (the
    scheduler forgot the key, as it does with every key of a client whose connection it closed),
    not merely lost with a worker (that one the scheduler recomputes from its ``load-`` task)."""
    blocks = [*data.train_images, *data.train_labels, *data.test_images, *data.test_labels]
    return any(f.cancelled() for f in blocks)


class RoundGraph:
    """Submits the tasks of one attempt of a run with stage-named keys, spans and resources.

    One per attempt: a replay after lost work makes a fresh one (``for_attempt``) whose keys
    carry a fresh token, so replayed tasks never meet a key the scheduler is still forgetting.
    Strategies build their rounds from these methods only.
    """

    def __init__(self, client: distributed.Client, data: Persisted, config, *, n_classes: int,
                 device: str, train_resources: dict | None, augment_resources: dict | None,
                 token: str | None = None, payload_bytes: int = 0, watchdog=None,
                 reload=None):
        self.client, self.data, self.config = client, data, config
        self.reload = reload  # () -> Persisted: the dataset persisted again (``ensure_data``)
        self.watchdog = watchdog  # pipeline.cluster.watchdog.Watchdog: looks at the tasks while we wait
        self.n_classes, self.device = n_classes, device
        self.train_resources, self.augment_resources = train_resources, augment_resources
        self.token = token or keys.new_token()
        self.payload_bytes = payload_bytes  # bytes of one replica's parameters
        self._perms: dict[int, np.ndarray] = {}
        self._placement: Placement | None = None  # made once an attempt (``placement``)
        self._shares: tuple = ()  # each replica's thread share, from the first placement
        self.averaged_bytes = payload_bytes  # bytes per replica an average adds (auto weighs)
        self._plan: algorithms.Plan | None = None
        self._tests: list | None = None  # (images, labels) of each test chunk where it is read

    def for_attempt(self) -> "RoundGraph":
        """The same graph builder under a fresh key token (and a fresh averaging plan: workers
        may have come or gone)."""
        fresh = RoundGraph(self.client, self.data, self.config, n_classes=self.n_classes,
                           device=self.device, train_resources=self.train_resources,
                           augment_resources=self.augment_resources,
                           payload_bytes=self.payload_bytes, watchdog=self.watchdog,
                           reload=self.reload)
        fresh.averaged_bytes = self.averaged_bytes
        return fresh

    # ---- where replicas live and how they average ----------------------------------------
    def average_plan(self) -> algorithms.Plan:
        """The averaging algorithm and the replicas' placement (``average.algorithm``; auto
        weighs ``averaged_bytes``), made once per attempt for the workers it sees then."""
        if self._plan is None:
            self._plan = algorithms.plan(
                self.client, self.config.average, self.config.train.replicas,
                self.averaged_bytes or None, self.train_resources)
        return self._plan

    def _average(self, *coords):
        """(algorithm module, context) of an average keyed ``("average-<token>", *coords, ...)``."""
        plan = self.average_plan()
        ctx = algorithms.context(plan, self.client, self.token, coords,
                                           self.config.average.fan_in, self.config.train.replicas)
        if plan.placement is None:  # one host: the tree's nodes where their inputs' replicas
            homes = self.placement.homes
            ctx = ctx._replace(homes=homes if None not in homes else None)
        return algorithms.get(plan.algorithm), ctx

    def mean(self, round_index: int, payloads: list, prepare=None):
        """Future of the payloads' exact mean (float64 sums in the fixed order of
        ``pipeline.averaging.order``, divided once, cast back), on replica 0's worker when replicas
        are placed. ``prepare`` turns a payload into the state dict to average, where it is
        consumed (default: the payload is one)."""
        algorithm, ctx = self._average(round_index)
        with distributed.span("average"):
            return algorithm.reduce(ctx._replace(prepare=prepare), payloads)

    def allreduce(self, round_index: int, payloads: list, prepare=None) -> list:
        """Per-replica futures of the mean, each where its replica will read it."""
        algorithm, ctx = self._average(round_index)
        with distributed.span("average"):
            return algorithm.allreduce(ctx._replace(prepare=prepare), payloads)

    def broadcast(self, round_index: int, value, what: str = "params") -> list:
        """Per-replica futures of ``value`` (made on replica 0's worker): the algorithm's
        broadcast, one copy per host. Keyed ``("average-<token>", round, what, ...)``."""
        algorithm, ctx = self._average(round_index, what)
        with distributed.span("average"):
            return algorithm.broadcast(ctx, value)

    def ensure_data(self, log) -> None:
        """Before a replay: persist the dataset again where the cluster forgot a block of it
        (``data_lost``); attempts made after this (``for_attempt``) read the new blocks."""
        if self.reload is not None and data_lost(self.data):
            log("the cluster forgot the dataset's blocks: loading them again")
            self.data, self._tests = self.reload(), None

    def replace(self) -> None:
        """Place the replicas again, on the workers there are now (``pipeline.training.elastic``
        calls it at a round boundary where they changed): tasks submitted from here go to the new
        homes and fetch the state and shards they need; those already submitted keep their soft
        pins. The averaging plan is made again with it. Each replica keeps the thread share of
        the attempt's first placement (with ``--cpu-kernels chainer`` BLAS's threads are part
        of the arithmetic): placement only, the same bits."""
        self._plan = self._placement = None

    @property
    def placement(self) -> Placement:
        """Where this attempt's replicas live, their thread shares and how their tasks are held
        there (``pipeline.training.placement``): made for the workers the averaging plan saw,
        once an attempt and again after ``replace``."""
        if self._placement is None:
            placed = place(self.client, self.config, self.average_plan(),
                           self.train_resources, self.augment_resources)
            self._shares = self._shares or placed.threads  # fixed for the attempt
            self._placement = placed._replace(threads=self._shares)
        return self._placement

    def _to_trainer(self, shard, replica: int, key: tuple):
        """Prefetch: the shard of ``replica`` moved to the worker its train- task will run on,
        while the current round trains. Where every worker may augment, the augment- task
        itself was placed there and this returns ``shard``; beside loader workers a ``move``
        task (asking for no resources, so a soft pin is safe) copies it over. The train- task
        then finds its input on its worker instead of fetching it once the average is in.
        Placement only: the bits are the same."""
        home = self.placement.home(replica)
        if home is None or self.placement.augment_anywhere:
            return shard
        return self._moved_to(shard, home, (*key, "move"))

    def _test_blocks(self) -> list:
        """``(images, labels)`` futures of each test chunk, moved once an attempt to the worker
        that evaluates it (chunk i: replica i mod K's, see ``submit_evaluate``) by a ``move``
        task (keyed ``("load-<token>", "test", i, part)``, asking for no resources: a soft pin
        is safe). An evaluate- task then finds its chunk there and runs as soon as the weights
        are in, before the next round's train- task (submitted after it), on every worker at
        once; fetching its chunk first, it let that train- task take the thread and ran at the
        round's end, one worker's share after another's."""
        if self._tests is None:
            replicas = self.config.train.replicas
            self._tests = []
            for i, chunk in enumerate(zip(self.data.test_images, self.data.test_labels)):
                home = self.placement.home(i % replicas)
                self._tests.append(tuple(
                    self._moved_to(value, home, self.key("load", "test", i, part))
                    for part, value in zip(("images", "labels"), chunk)))
        return self._tests

    def _moved_to(self, value, home: str | None, key):
        """``value`` copied to worker ``home`` (soft pin) by a ``move`` task; itself without one."""
        return value if home is None else self.client.submit(
            move, value, key=key, pure=False, workers=[home], allow_other_workers=True)

    def key(self, stage: str, *coords):
        return keys.make(stage, self.token, *coords)

    def _submit(self, func, *args, key, resources=None):
        return self.client.submit(func, *args, key=key, pure=False, resources=resources)

    def submit(self, func, *args, stage: str, coords: tuple = (), fields: tuple | None = None,
               train: bool = False, pin: int | None = None):
        """Submit ``func(*args)`` as ``(stage-token, *coords)`` inside a span named ``stage``.

        ``fields``: names of the fields of a tuple result; each becomes its own small task
        ``(stage-token, *coords, name)`` so consumers fetch only that part; returns their
        futures. ``train``: ask for the train resources (a GPU). ``pin``: run where replica
        ``pin`` lives (``Placement.pinned``), e.g. next to the mean that ``mean`` left there.
        """
        resources = self.train_resources if train else None
        where = (self.placement.pinned(pin, resources) if pin is not None
                 else {"resources": resources})
        with distributed.span(stage):
            key = self.key(stage, *coords)
            fut = self.client.submit(func, *args, key=key, pure=False, **where)
            if fields is None:
                return fut
            return tuple(self.client.submit(pick, fut, i, key=(*key, name), pure=False, **where)
                         for i, name in enumerate(fields))

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
            from pipeline.data.images import submit_decode
            with distributed.span("decode"):
                images, labels, starts = submit_decode(
                    self._submit, self.key, self.data.stream, indices, rnd.index, replica,
                    self.augment_resources)
            indices = np.arange(len(indices))
        key = self.key("augment", rnd.index, replica)
        where = self.placement.augment_where(replica)
        with distributed.span("augment"):
            shard = self.client.submit(augment, images, labels, starts, indices, positions,
                                       cfg.augment.policy, cfg.seed, rnd.epoch,
                                       cfg.augment.chunk, key=key, pure=False,
                                       resources=self.augment_resources, **where)
            return self._to_trainer(shard, replica, key)

    def submit_train(self, rnd: Round, replica: int, params, opt, shard, spec: tasks.StepSpec,
                     pin: int | None = None) -> Trained:
        """The futures of a replica's train- task. ``pin``: the replica whose worker it prefers
        (default ``replica``) when ``cluster.pin_replicas`` is on."""
        home = replica if pin is None else pin
        if not spec.threads:
            spec = spec._replace(threads=self.placement.threads[home])
        with distributed.span("train"):
            key = self.key("train", rnd.index, replica)
            where = self.placement.pinned(home, self.train_resources)
            fut = self.client.submit(tasks.train, params, opt, shard, spec, key=key, pure=False,
                                     **where)
            # The picks ask for what the train- task did and where: unpinned, the scheduler gave
            # one to the other worker when this one was busy (an evaluate- task), which fetched
            # the whole result (params and optimizer state) to take a part and sent the part
            # back for the next round (two copies between rounds); and a recomputed pick after a
            # lost worker would fetch the whole result to any worker (a loader).
            picks = tuple(self.client.submit(pick, fut, i, key=(*key, name), pure=False,
                                             **where)
                          for i, name in enumerate(("params", "opt", "metrics")))
            return Trained(*picks, fut)

    def submit_evaluate(self, rnd_index: int, copies: list, spec: tasks.EvalSpec) -> list:
        """The evaluate- tasks of the weights in ``copies`` (futures of the same weights: one,
        or one per replica where each reads it). Test chunk i runs next to replica i mod K
        (a soft pin, like its train- tasks) and reads the copy there, so an epoch's evaluation
        is split evenly over the training workers: each spends its share at the round's barrier,
        where one worker taking it all (Dask's choice, next to the one copy) held the others
        waiting for it (0.1-0.7 s an epoch on two workers)."""
        replicas = self.config.train.replicas
        if not spec.threads:  # any training worker may evaluate: the smallest share
            spec = spec._replace(threads=self.placement.smallest_share())
        with distributed.span("evaluate"):
            return [self.client.submit(tasks.evaluate, copies[i % replicas % len(copies)],
                                       images, labels, spec,
                                       key=self.key("evaluate", rnd_index, i), pure=False,
                                       **self.placement.pinned(i % replicas,
                                                               self.train_resources))
                    for i, (images, labels) in enumerate(self._test_blocks())]

    def scatter(self, value, replica: int | None = None):
        """Put a host value on the cluster as a root with no lineage (checkpoints, resumes), on
        ``replica``'s worker when replicas are placed."""
        return self.scatter_many([value], replica)[0]

    def scatter_many(self, values: list, replica: int | None = None) -> list:
        """``scatter`` of several values in one round trip; a ``None`` stays ``None``."""
        present = [v for v in values if v is not None]
        for again in (False, True):
            home = self.placement.home(replica) if replica is not None else None
            where = [home] if home is not None else None
            try:
                futures = iter(self.client.scatter(present, hash=False, workers=where)
                               if present else ())
                break
            except KeyError as exc:  # the scheduler no longer knows `where`: retired since
                # the last placement (Dask's retire_workers, an adaptive scale-down, the
                # watchdog): place again once; gone again, it is lost work, replayed
                if again:
                    raise ConnectionError(f"scatter to {where}: the worker is gone ({exc})") \
                        from None
                self.replace()
        return [next(futures) if v is not None else None for v in values]

    def scatter_shared(self, value, round_index: int, what: str = "scatter") -> list:
        """A value every replica starts round ``round_index`` from (the shared parameters):
        put on replica 0's worker, then sent on by the averaging algorithm's broadcast (one copy
        per host, not one per replica from the driver). Per-replica futures."""
        return self.broadcast(round_index, self.scatter(value, replica=0), what)

    def gather(self, futures):
        """Host values of (nested lists of) futures: the driver's one way to wait. While it
        waits, the stalled-task watchdog looks at this attempt's tasks."""
        if self.watchdog is not None:
            return self.watchdog.gather(futures, keys.suffix(self.token))
        return self.client.gather(futures)

    def first_done(self, futures: list) -> list:
        """The futures of ``futures`` that are done, waiting until at least one is (in the
        order given). What asynchronous strategies react to."""
        from distributed.client import FIRST_COMPLETED, _wait
        if self.watchdog is not None:
            self.watchdog.wait(futures, keys.suffix(self.token), first=True)
        else:  # wait() needs a default client; this one may not be
            self.client.sync(_wait, futures, return_when=FIRST_COMPLETED)
        return [f for f in futures if f.done()]


def futures_of(values) -> list:
    """Every future held in (nested containers of) ``values``."""
    return distributed.futures_of(values)
