"""A run's set-up as values: what is checked before a cluster starts (``Prepared``: config, data,
plan, the state a resume goes on from) and what is built on the cluster (``Setup``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import augment as aug
from pipeline.averaging import exact
from pipeline.backends import get_backend
from pipeline.backends import user as user_code
from pipeline.core import precision
from pipeline.core.config import Config
from pipeline.core.errors import ResumeError, UsageError
from pipeline.outputs import checkpoint
from pipeline.outputs import resume as resuming
from pipeline.core.state import HostState
from pipeline.training import strategies
from pipeline.training.strategies.base import Context

if TYPE_CHECKING:
    from pipeline.backends import ModelRef, OptimizerRef
    from pipeline.cluster.watchdog import Watchdog
    from pipeline.data.datasets import Dataset
    from pipeline.training.graph import RoundGraph


def normalise(config: Config) -> Config:
    """``config`` validated, with its auto fields filled by the strategy's recipe (config.json
    shows them)."""
    config.validate()
    from pipeline.data.datasets import facts
    facts(config.data.dataset)  # a kind some reader records (DataError naming data.dataset)
    backend = get_backend(config.model.backend)  # the framework, resolved once a run
    backend.check_model(config.model.name)  # a name, or the form pkg.module:factory
    aug.get_policy(config.augment.policy)  # ValueError naming augment.policy
    strategy = strategies.get(config.train.strategy)  # ValueError naming the registry's names
    from pipeline.averaging import algorithms
    if config.average.algorithm != "auto":
        algorithms.get(config.average.algorithm)  # the same for the averaging algorithm
    strategy.check(config)
    config = strategy.resolve(config)
    backend.check_optimizer(config.train)  # its name and arguments, one line
    check_precision(config)
    return config


def check_precision(config: Config, flags: set | None = None) -> None:
    """Refuses a ``--precision`` this run cannot honour, in one line, before any cluster
    (``flags``: the CPU's, read from /proc/cpuinfo when None)."""
    if config.train.precision == "fp32":
        return
    line = precision.refusal(config.train.precision, config.train.device,
                             config.model.cpu_kernels, config.model.backend,
                             precision.cpu_flags() if flags is None else flags)
    backend = get_backend(config.model.backend)
    if line is None and hasattr(backend, "precision_unavailable"):  # its kernels' library
        line = backend.precision_unavailable(config.train.precision)
    if line is not None:
        raise UsageError(line)


def dataset_label(source: str) -> str:
    """A short name for the data in titles: the directory or archive name, or synthetic:N:M.

    >>> dataset_label("/data/cifar-10-batches-py/"), dataset_label("synthetic")
    ('cifar-10-batches-py', 'synthetic')
    """
    return Path(str(source).rstrip("/")).name or str(source)


# ---- the model ----------------------------------------------------------------------------------
def user_model(config: Config, model) -> tuple[Config, object]:
    """``(config, factory)``: the model the caller named (``train(model=...)``: a callable, or an
    import path ``"pkg.module:factory"``, imported now) recorded in ``model.name``, or
    ``(config, None)`` for a registry name. A config naming an import path (a run directory's
    config.json) with no ``model`` is one line saying which model to name: never imported."""
    backend = get_backend(config.model.backend)  # first: its framework, patched (Chainer on
    #                                               NumPy 2), before the user's code
    if model is None:
        name = config.model.name
        if name not in backend.model_names() and user_code.is_import_path(name):
            raise user_code.needs_model()
        return config, None
    if isinstance(model, str):
        return config.replace(**{"model.name": model}), user_code.import_factory(model)
    return config.replace(**{"model.name": user_code.path_of(model)}), model


def user_optimizer(config: Config, optimizer) -> tuple[Config, object]:
    """``(config, OptimizerRef)``: the optimizer factory the caller named (``train(optimizer=
    ...)``: a callable, or an import path, imported now), checked by one update, recorded in
    ``train.optimizer`` with its learning rate as ``train.lr`` (the base of the run's schedule);
    ``(config, None)`` for an optimizer by name. A config naming an import path with no
    ``optimizer`` is one line saying to name it again: never imported."""
    backend = get_backend(config.model.backend)
    if optimizer is None:
        if user_code.is_import_path(config.train.optimizer):
            raise user_code.needs_optimizer()
        return config, None
    if not hasattr(backend, "resolve_optimizer"):
        raise UsageError(f"model.backend {config.model.backend} takes no optimizer factory")
    ref = backend.resolve_optimizer(optimizer, config.train)
    changes = {"train.optimizer": ref.path}
    if ref.lr is not None:
        changes["train.lr"] = ref.lr
    return config.replace(**changes), ref


def image_size(config: Config, dataset) -> tuple:
    """(H, W) of the images the model sees: the data's, else what an image reader will make."""
    if dataset is not None:
        return tuple(int(s) for s in dataset.train_images.shape[2:])
    if config.model.input_size:  # recorded by the run (evaluate, load_model)
        return config.model.input_size, config.model.input_size
    from pipeline.data.images import DEFAULT_SIZE
    side = config.data.image_size or DEFAULT_SIZE
    return side, side


def resolve_model(config: Config, factory, dataset, optimizer=None):
    """What the tasks build (a registry name, or a ``ModelRef`` checked by a dry forward at the
    data's size and one training step with the run's optimizer: ``optimizer``, the user's
    ``OptimizerRef``, else train.optimizer by name). Without the dataset yet (image folders,
    scanned on the cluster) the class count is left unchecked until it is known."""
    n_classes = dataset.n_classes if dataset is not None else None
    user_opt = {} if optimizer is None else {"optimizer": optimizer}
    return get_backend(config.model.backend).resolve_model(
        config.model.name, config.model.args, factory, image_size(config, dataset), n_classes,
        train=config.train, **user_opt)


# ---- what the run directory records of its data ------------------------------------------
def kept_split(dataset) -> dict | None:
    """The evaluation split a run keeps (``pipeline.data.kept``) when no source finds its data
    again: arrays given from Python, up to kept.MAX_KEPT_BYTES; else None."""
    from pipeline.data import kept
    from pipeline.data.datasets import facts
    if facts(dataset.kind).refindable or not kept.fits(dataset.test_images.nbytes):
        return None
    import dask
    return kept.to_keep(*dask.compute(dataset.test_images, dataset.test_labels))


def data_record(dataset, kept: bool = False) -> dict:
    """``OUT/data.json``: what the run's data was (kind, class names, splits and their sizes),
    for ``predict`` and for readers of the run (pipeline.outputs.run_dir); ``eval_file``: the
    evaluation split the run kept (pipeline.data.kept), or null."""
    from pipeline.data.kept import EVAL_FILE
    return {"kind": dataset.kind, "source": str(dataset.source),
            "eval_file": EVAL_FILE if kept else None,
            "class_names": [str(n) for n in dataset.label_names],
            "n_classes": int(dataset.n_classes),
            "splits": {"train": dataset.splits[0], "eval": dataset.splits[1]},
            "images": {dataset.splits[0]: int(dataset.train_images.shape[0]),
                       dataset.splits[1]: int(dataset.test_images.shape[0])},
            "image_shape": [int(n) for n in dataset.train_images.shape[1:]]}


# ---- before a cluster starts -----------------------------------------------------------------
class Prepared(NamedTuple):
    """What a run knows before a cluster starts: data, plan and the state it starts from."""
    dataset: Dataset  # lazy; validated on the driver
    rounds: list  # the plan: pipeline.core.schedule.Round for every round of the run
    per_epoch: int
    period: int
    state: HostState | None  # the checkpoint a resume goes on from (None: from the start)
    model: str | ModelRef | None = None  # what tasks build (resolve_model)
    optimizer: OptimizerRef | None = None  # the user's optimizer (None: train.optimizer)

    @property
    def complete(self) -> bool:
        return self.state is not None and self.state.round >= len(self.rounds) - 1


def reads_on_driver(config: Config) -> bool:
    """Whether the data source is checked on the driver (CIFAR, synthetic), not in scan- tasks."""
    from pipeline.data.datasets import checks_on_driver
    return checks_on_driver(config.data.source, config.data)


def checks_before_cluster(config: Config, client=None) -> bool:
    """Whether the run reads and checks its data before it connects: always for CIFAR and
    synthetic data; for image folders and file lists when it will start a local cluster (the
    files are this machine's), not on a given client or --scheduler."""
    from pipeline.cluster.connection import scheduler_address
    return reads_on_driver(config) or (client is None
                                       and scheduler_address(config.cluster) is None)


def load_dataset(config: Config, client=None):
    from pipeline.data.datasets import load_dataset as load
    cfg = config.data
    return load(cfg.source, cfg, download=cfg.download, client=client)


def given_data(config: Config, data, client, log):
    """``train(config, data=...)``: ``(config, dataset, client)`` with the data checked and
    summarised in the log (pipeline.data.arrays), ``data.source`` its fingerprint (so a resume
    with other data is refused) and the client that holds persisted arrays when none is given.
    ``(config, None, client)`` without data."""
    if data is None:
        return config, None, client
    from pipeline.data import arrays
    from pipeline.data.datasets import load_dataset as load
    client = client if client is not None else arrays.client_of(data)
    dataset = load(data, config.data, client=client)
    n_train, n_test = (int(a.shape[0]) for a in (dataset.train_images, dataset.test_images))
    for line in arrays.summary_lines(dataset.info, n_train, n_test,
                                     dataset.train_images.shape[1:]):
        log(line)
    return config.replace(**{"data.source": dataset.source}), dataset, client


def check_device(config: Config) -> list:
    """GPU ids for an embedded cluster; refuses ``--device gpu`` where it cannot work before a
    cluster starts (with ``--scheduler`` the workers' resources decide, after connecting)."""
    from pipeline.cluster.connection import scheduler_address
    from pipeline.cluster.embedded import local_gpus
    device = config.train.device
    if device == "cpu":
        return []
    gpus = local_gpus()
    if device == "gpu" and scheduler_address(config.cluster) is None:
        import importlib.util
        if not gpus:
            raise UsageError("--device gpu: this machine has no GPU for the local cluster "
                             "(nvidia-smi lists none, or CUDA_VISIBLE_DEVICES is empty); use "
                             "--device cpu, or --scheduler ADDR of a cluster with GPU workers")
        if importlib.util.find_spec("cupy") is None:
            raise UsageError("--device gpu needs CuPy: pip install -e '.[gpu]' (or --device cpu)")
    return gpus


def plan(config: Config, out, dataset, found: "resuming.Resume | None",
         model=None, optimizer=None) -> Prepared:
    """The plan (the strategy's) and the state to start from; a resume keeps the finished
    rounds as the checkpoint's run planned them and plans on to ``train.epochs``. ``model``
    and ``optimizer`` (the user's) are what the tasks build, as ``resolve_model`` and
    ``user_optimizer`` gave them."""
    strategy = strategies.get(config.train.strategy)
    n_train = int(dataset.train_images.shape[0])
    state, done = None, []
    if found is not None:
        state = found.state
        if state is not None:
            before = config.replace(**{"train.epochs": found.saved["train"]["epochs"]})
            done = strategy.plan(before, n_train)[0][:state.round + 1]
    rounds, per_epoch, period = strategy.plan(config, n_train, done)
    if state is not None:
        _check_resumed(config, out, state, dataset.n_classes, model)
        _check_classes(out, tuple(dataset.label_names))
    elif config.model.init_weights is not None:  # read and checked now, before a cluster
        initial_params(config, dataset.n_classes, model)
    if state is not None and len(done) == len(rounds):
        trained = (done[-1].global_step + done[-1].steps) / per_epoch
        if trained > config.train.epochs + 1e-9:
            raise ResumeError(f"{out} has trained {trained:g} epochs already, more than "
                              f"--epochs {config.train.epochs:g}")
    return Prepared(dataset, rounds, per_epoch, period, state, model, optimizer)


def _check_resumed(config: Config, out, state: HostState, n_classes: int, model=None) -> None:
    """The checkpoint's arrays fit the model (names, shapes, dtypes) before anything is sent."""
    if len(state.params) < config.train.replicas or len(state.opts) != len(state.params):
        raise ResumeError(f"checkpoint of round {state.round} in {out} holds "
                          f"{len(state.params)} parameter set(s), the run has "
                          f"{config.train.replicas} replica(s)")
    template = initial_params(config, n_classes, model, weights=False)
    checkpoint.check_state(state, template, f"round {state.round} in {out}")


def _check_classes(out, names: tuple) -> None:
    """ResumeError when the run's ``data.json`` names its classes otherwise than the data now
    does: the checkpoint's class i would be trained on another class's images."""
    from pipeline.data.readers import NAMES_JSON_BYTES
    from pipeline.outputs.fs import MAX_CONFIG_BYTES, read_json
    if out is None or not (Path(out) / "data.json").is_file():
        return
    path = Path(out) / "data.json"
    record = read_json(path, ResumeError, limit=MAX_CONFIG_BYTES + NAMES_JSON_BYTES)
    saved = record.get("class_names") if isinstance(record, dict) else None
    if isinstance(saved, list) and saved != list(names):
        i = next((i for i, (a, b) in enumerate(zip(saved, names)) if a != b), min(len(saved),
                                                                                    len(names)))
        raise ResumeError(f"{out} was trained on {len(saved)} classes, class {i} named "
                          f"{(saved[i:i + 1] or [None])[0]!r:.60}; the data now gives "
                          f"{len(names)}, class {i} named {(names[i:i + 1] or (None,))[0]!r:.60} "
                          "(resume with the run's data, or start a new run)")


def initial_params(config: Config, n_classes: int, model=None, weights: bool = True) -> dict:
    """The weights every replica starts from: the run seed's, or ``model.init_weights`` (read
    with our own reader, every name, shape and dtype checked: one line on the first mismatch)."""
    from pipeline.core import npz
    from pipeline.training import tasks
    model = config.model.name if model is None else model
    path = config.model.init_weights
    if not weights or path is None:
        return tasks.init_params(model, n_classes, config.seed, config.model.backend)
    try:
        return get_backend(config.model.backend).load_weights(model, n_classes, path)
    except npz.Mismatch as exc:
        raise UsageError(f"--init-weights {path} does not fit model "
                         f"{config.model.name} ({n_classes} classes): {exc.reason}") from None


# ---- on the cluster --------------------------------------------------------------------------
class Setup(NamedTuple):
    """What a run builds on the cluster before its first round."""
    graph: RoundGraph  # each attempt takes a fresh token of it
    watchdog: Watchdog  # looks at the tasks while we wait
    ctx: Context
    strategy: type  # the Strategy class of train.strategy
    initial: dict  # the model's initial parameters (a run from the start begins there)
    load_seconds: float  # set-up time, charged to the first round's "load" stage


def on_cluster(client, config: Config, prep: Prepared, log) -> Setup:
    """Persist the dataset, pick the device and the resources tasks ask for, build the graph."""
    from pipeline.cluster.watchdog import Watchdog
    from pipeline.training import graph
    t0 = time.perf_counter()
    dataset = prep.dataset
    device, train_res = _device(client, config, log)
    augment_res = _augment_resources(client, config, device, train_res, log)
    data = graph.persist_dataset(client, dataset, resources=augment_res)
    if data.note:
        log(data.note)
    initial = initial_params(config, dataset.n_classes, prep.model)
    watchdog = Watchdog(client, config.cluster, log)  # looks while the loop waits
    round_graph = graph.RoundGraph(client, data, config, n_classes=dataset.n_classes,
                                   device=device, train_resources=train_res,
                                   augment_resources=augment_res,
                                   payload_bytes=exact.nbytes(initial), watchdog=watchdog,
                                   reload=lambda: graph.persist_dataset(client, dataset,
                                                                        resources=augment_res))
    ctx = Context(config, config.train.replicas, data.n_train, prep.per_epoch,
                  dataset.n_classes, device, tuple(prep.rounds), prep.model, prep.optimizer)
    setup = Setup(round_graph, watchdog, ctx, strategies.get(config.train.strategy), initial,
                  time.perf_counter() - t0)
    _log_plan(setup, prep, log)
    _plan_average(setup, log)
    return setup


def _device(client, config: Config, log):
    """``(device, resources train- and evaluate- tasks ask for)``: the GPU resource, or on the
    CPU ``train.cpu_resource`` when a worker advertises it (training workers beside loaders)
    and otherwise none (any worker)."""
    from pipeline.cluster import resources as offers
    t, c = config.train, config.cluster
    cpu = ("cpu", {t.cpu_resource: 1} if offers.has_resource(client, t.cpu_resource) else None)
    if t.device == "cpu":
        return cpu
    if t.device == "gpu":
        offers.require_resource(client, t.gpu_resource, c.resource_timeout)
    elif not offers.has_resource(client, t.gpu_resource):
        return cpu
    for line in offers.check_gpu_workers(client, t.gpu_resource):
        log(f"GPU worker {line}")
    return "gpu", {t.gpu_resource: 1}


def _augment_resources(client, config: Config, device: str, train_res, log) -> dict | None:
    """What decode- and augment- tasks ask for: ``augment.resource`` where a worker offers it."""
    from pipeline.cluster import resources as offers
    name, trainers = config.augment.resource, config.train.cpu_resource
    resources = {name: 1} if offers.has_resource(client, name) else None
    if device == "cpu" and train_res:
        log(f"train-/evaluate- tasks on the workers advertising {trainers}, decode-/augment- on "
            f"those advertising {name}" if resources else
            f"train-/evaluate- tasks on the workers advertising {trainers}")
    return resources


def _log_plan(setup: Setup, prep: Prepared, log) -> None:
    """The run in one line."""
    cfg, ctx = setup.ctx.config, setup.ctx
    t = cfg.train
    log(f"{t.strategy}: {ctx.replicas} replica(s) x batch {t.batch_size}, {len(prep.rounds)} "
        f"rounds of up to {prep.period} step(s), {ctx.per_epoch} steps/epoch, "
        f"{ctx.n_train} training images of {ctx.n_classes} classes "
        f"({getattr(prep.dataset, 'kind', cfg.data.dataset)}), model {cfg.model.name}, "
        f"device {ctx.device}")


def _plan_average(setup: Setup, log) -> None:
    """Tell the graph the bytes one average adds (``--average auto`` weighs them) and log how
    the replicas' mean travels (pipeline.averaging.algorithms); strategies that never average
    skip both."""
    averaged = setup.strategy.average_payload(setup.ctx.config, setup.graph.payload_bytes)
    if averaged:
        setup.graph.averaged_bytes = averaged
        log(f"average: {setup.graph.average_plan().description}")
