"""The run configuration: frozen dataclasses in small sections, validated with errors that name the field."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from dataclasses import dataclass, field

STRATEGIES = ("single", "gradient", "mixture", "ipm", "async")  # pipeline.training.strategies
#                                         registers one class per name (a test checks both agree)

OPTIMIZERS = ("sgd", "momentum", "adam")
DEVICES = ("cpu", "gpu", "auto")
OPT_STATE_MODES = ("auto", "keep", "reset", "average")
LR_SCALINGS = ("auto", "none", "linear", "sqrt")
LR_DECAYS = ("none", "cosine")
CPU_KERNELS = ("ours", "chainer")
AVERAGE_ALGORITHMS = ("auto", "tree", "sharded", "hierarchical")


MAX_EPOCHS = 100_000.0
MAX_REPLICAS = 4096  # also what a checkpoint may hold (pipeline.outputs.checkpoint.MAX_REPLICAS)
DAY_S = 86_400.0  # longest timeout: a day


def _check(condition: bool, name: str, message: str, value) -> None:
    if not condition:
        raise ValueError(f"{name} {message}, got {_short(value)}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is(value, kind: str) -> bool:
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, str)


_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "None": "null"}


def _check_types(section, prefix: str) -> None:
    """Every field of a section has its declared type (``int``, ``float | None``, ...) and every
    number is finite: config.json on a resume is input like any other."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        name = f"{prefix}{f.name}"
        if not any(_is(value, kind) for kind in kinds):
            raise ValueError(f"{name} must be {' or '.join(_WORDS[k] for k in kinds)}, "
                             f"got {_short(value)}")
        if isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {_short(value)}")


def _in(value, lo, hi, name: str, closed_lo: bool = True, closed_hi: bool = True) -> None:
    ok = (lo <= value if closed_lo else lo < value) and (value <= hi if closed_hi else value < hi)
    _check(ok, name, f"must be in {'[' if closed_lo else '('}{lo:g}, {hi:g}"
                     f"{']' if closed_hi else ')'}", value)


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # "synthetic", "synthetic:N:M" (train:test images), a CIFAR path,
    #                            an image folder (root/<class>/<image>) or a file list (path label)
    cache_dir: str | None = None  # where downloads go; None = ~/.cache/dask-chainer-pipeline
    download: bool = False  # fetch the official archive (MD5-checked) into cache_dir when missing
    dataset: str = "cifar10"  # cifar10 | cifar100 (python format) ; label kind below for cifar100
    label_kind: str = "fine"  # CIFAR-100 only: "fine" (100 classes) or "coarse" (20)
    # Image folders and file lists (pipeline.data.imagefolder):
    image_size: int | None = None  # side of the square images the model sees (pixels);
    #                                None = 64 for image sources (CIFAR is always 32)
    val_fraction: float = 0.1  # share of each class held out for val when there is no val split
    val_source: str | None = None  # a folder or file list to use as the val split instead
    image_root: str | None = None  # file lists: where relative paths start (None: the list's dir)
    split_seed: int = 0  # seed of the held-out val split (a property of the data, not the run)
    cache: str = "auto"  # keep decoded training images on the workers: auto (if they fit) | on | off
    max_pixels: int = 1 << 26  # images with more pixels (width x height) are refused
    decode_chunk: int = 128  # images per scan- / decode- task

    def validate(self) -> None:
        _check_types(self, "data.")
        _check(bool(self.source), "data.source", "must not be empty", self.source)
        _check(self.image_size is None or 16 <= self.image_size <= 1024, "data.image_size",
               "must be in [16, 1024] pixels", self.image_size)
        _check(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)",
               self.val_fraction)
        _check(self.split_seed >= 0, "data.split_seed", "must be >= 0", self.split_seed)
        _check(self.cache in ("auto", "on", "off"), "data.cache", "must be auto, on or off",
               self.cache)
        _check(self.max_pixels >= 1, "data.max_pixels", "must be >= 1", self.max_pixels)
        _check(self.decode_chunk >= 1, "data.decode_chunk", "must be >= 1", self.decode_chunk)
        _check(self.dataset in ("cifar10", "cifar100"), "data.dataset", "must be cifar10 or cifar100",
               self.dataset)
        _check(self.label_kind in ("fine", "coarse"), "data.label_kind", "must be fine or coarse",
               self.label_kind)


@dataclass(frozen=True)
class AugmentConfig:
    policy: str = "cifar"  # name from augment.POLICIES: none | flip | cifar | cifar-cutout
    chunk: int = 1000  # images per augment- seed chunk (global index ranges, not per worker)
    resource: str = "CPU"  # worker resource that augment- tasks ask for when a worker advertises it
    prefetch: int = 1  # rounds of augmentation computed ahead of training (memory: depth x shard)

    def validate(self) -> None:
        _check_types(self, "augment.")
        _check(self.chunk >= 1, "augment.chunk", "must be >= 1", self.chunk)
        _check(self.prefetch >= 0, "augment.prefetch", "must be >= 0", self.prefetch)
        _check(self.prefetch <= 100, "augment.prefetch", "must be <= 100 (rounds held ahead)",
               self.prefetch)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "small-cnn"  # key of pipeline.backends.chainer.models.MODELS
    n_classes: int = 10  # output units; taken from the data when it says otherwise
    cpu_kernels: str = "ours"  # convolution/pooling/BatchNorm on NumPy: ours (pipeline.backends.chainer.cpu_kernels,
    #                            2-3.7x faster) | chainer (Chainer's functions); CuPy: Chainer's

    def validate(self) -> None:
        _check_types(self, "model.")
        _in(self.n_classes, 2, 100_000, "model.n_classes")
        _check(self.cpu_kernels in CPU_KERNELS, "model.cpu_kernels", f"must be one of {CPU_KERNELS}",
               self.cpu_kernels)


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "ipm"  # single | gradient | mixture | ipm | async (pipeline.training.strategies)
    replicas: int = 4  # K model replicas; independent of the number of workers
    epochs: float = 2.0  # passes over the training set (fractions allowed, e.g. 0.5)
    batch_size: int = 64  # images per replica per step (B); gradient's global batch is K x B
    optimizer: str = "momentum"  # sgd | momentum | adam
    lr: float = 0.01  # replica learning rate (Adam: alpha), before scaling and warmup
    momentum: float = 0.9  # momentum optimizer only
    weight_decay: float = 0.0  # L2 coefficient, applied by the optimizer
    beta1: float | None = None  # Adam's first-moment decay; None: the recipe's (plain 0.9)
    beta2: float | None = None  # Adam's second-moment decay; None: the recipe's (plain 0.999)
    adam_eps: float | None = None  # Adam's epsilon; None: the recipe's (plain 1e-8)
    lr_scaling: str = "auto"  # none | linear | sqrt: multiply lr by K or sqrt(K) (Horovod, seed
    #                           004); auto: the strategy's recipe (none unless it says otherwise)
    warmup_epochs: float | None = None  # linear lr warmup over this many epochs (seed 004);
    #                                     None: the strategy's recipe (0 unless it says otherwise)
    lr_decay: str = "none"  # none | cosine: after the warmup, lower the lr along a half cosine
    #                         to 0 at train.epochs (the horizon: --resume --epochs changes it)
    recipe: bool = True  # fill "auto" fields with the strategy's scale-out recipe for K > 1
    #                      (docs/scaling.md); False: the plain values
    device: str = "cpu"  # cpu | gpu | auto (gpu when a worker advertises the GPU resource)
    gpu_resource: str = "GPU"  # worker resource name that GPU train- tasks ask for
    cpu_resource: str = "TRAIN"  # worker resource that CPU train-/evaluate- tasks ask for when a
    #                              worker advertises it (training workers beside loader workers)
    tta: bool = False  # evaluate with test-time augmentation (flip + shifted crops)

    def validate(self) -> None:
        _check_types(self, "train.")
        _check(self.strategy in STRATEGIES, "train.strategy", f"must be one of {STRATEGIES}",
               self.strategy)
        _check(self.replicas >= 1, "train.replicas", "must be >= 1", self.replicas)
        _check(self.replicas <= MAX_REPLICAS, "train.replicas", f"must be <= {MAX_REPLICAS}",
               self.replicas)
        _check(self.strategy != "single" or self.replicas == 1, "train.replicas",
               "must be 1 for strategy single", self.replicas)
        _check(self.epochs > 0, "train.epochs", "must be > 0", self.epochs)
        _check(self.epochs <= MAX_EPOCHS, "train.epochs", f"must be <= {MAX_EPOCHS:g}",
               self.epochs)
        _check(self.batch_size >= 1, "train.batch_size", "must be >= 1", self.batch_size)
        _check(self.batch_size <= 1 << 20, "train.batch_size", "must be <= 1048576",
               self.batch_size)
        _check(self.optimizer in OPTIMIZERS, "train.optimizer", f"must be one of {OPTIMIZERS}",
               self.optimizer)
        _check(self.lr > 0, "train.lr", "must be > 0", self.lr)
        _check(0 <= self.momentum < 1, "train.momentum", "must be in [0, 1)", self.momentum)
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check(value is None or 0 <= value < 1, f"train.{name}", "must be in [0, 1)", value)
        _check(self.adam_eps is None or self.adam_eps > 0, "train.adam_eps", "must be > 0",
               self.adam_eps)
        _check(self.lr_scaling in LR_SCALINGS, "train.lr_scaling", f"must be one of {LR_SCALINGS}",
               self.lr_scaling)
        _check(self.lr_decay in LR_DECAYS, "train.lr_decay", f"must be one of {LR_DECAYS}",
               self.lr_decay)
        _check(self.warmup_epochs is None or self.warmup_epochs >= 0, "train.warmup_epochs",
               "must be >= 0", self.warmup_epochs)
        _check(self.device in DEVICES, "train.device", f"must be one of {DEVICES}", self.device)


_MIX_RE = re.compile(r"^(\d{1,9})(ep)?$")  # nine digits: a billion steps is past any plan


@dataclass(frozen=True)
class AverageConfig:
    mix_every: str | int = "10"  # ipm period H: "10" = 10 local steps, "1ep" = one epoch
    fan_in: int = 4  # children per average- task in the reduction tree (dask's split_every);
    #                  fewer levels move fewer float64 partial sums (benchmarks/averaging.py)
    outer_lr: float | None = None  # outer optimizer on the averaged update (DiLoCo); 1 = plain
    #                                averaging; None: the strategy's recipe (1 unless it says)
    outer_momentum: float = 0.0  # Nesterov momentum of the outer optimizer; 0 = plain averaging
    outer_warmup_epochs: float | None = None  # outer lr ramps from 1 to outer_lr over these
    #                                           epochs; None: the strategy's recipe (0 otherwise)
    adaptive_outer: bool | None = None  # multiply the outer lr by the replicas' AdaScale gain
    #                                     (1..K); None: the strategy's recipe (off otherwise)
    optimizer_state: str = "auto"  # keep | reset | average the replicas' optimizer state at a
    #                                mix; auto: the strategy's recipe (keep unless it says)
    algorithm: str = "auto"  # auto | tree | sharded | hierarchical (pipeline.averaging.algorithms);
    #                          auto: tree on one host, else the cost model's fastest. Same bits.
    shards: int = 0  # S of sharded/hierarchical: 0 = one per host (one per worker on one host)
    link_gbps: float = 10.0  # link rate between hosts that auto's cost model assumes, Gb/s

    def validate(self) -> None:
        _check_types(self, "average.")
        match = _MIX_RE.match(str(self.mix_every))
        _check(match is not None and int(match.group(1)) >= 1, "average.mix_every",
               "must be a positive step count like 10 or epochs like 1ep", self.mix_every)
        _check(self.fan_in >= 2, "average.fan_in", "must be >= 2", self.fan_in)
        _check(self.fan_in <= 1024, "average.fan_in", "must be <= 1024", self.fan_in)
        _check(self.outer_lr is None or self.outer_lr > 0, "average.outer_lr", "must be > 0",
               self.outer_lr)
        _check(self.outer_warmup_epochs is None or 0 <= self.outer_warmup_epochs <= MAX_EPOCHS,
               "average.outer_warmup_epochs", f"must be in [0, {MAX_EPOCHS:g}]",
               self.outer_warmup_epochs)
        _check(0 <= self.outer_momentum < 1, "average.outer_momentum", "must be in [0, 1)",
               self.outer_momentum)
        _check(self.optimizer_state in OPT_STATE_MODES, "average.optimizer_state",
               f"must be one of {OPT_STATE_MODES}", self.optimizer_state)
        _check(self.algorithm in AVERAGE_ALGORITHMS, "average.algorithm",
               f"must be one of {AVERAGE_ALGORITHMS}", self.algorithm)
        _in(self.shards, 0, 1024, "average.shards")  # tasks per average grow with S
        _in(self.link_gbps, 0, 10_000, "average.link_gbps", closed_lo=False)

    def period(self, steps_per_epoch: int) -> int:
        """H in local steps: "10" -> 10, "2ep" -> 2 * steps_per_epoch."""
        number, epochs = _MIX_RE.match(str(self.mix_every)).groups()
        return int(number) * steps_per_epoch if epochs else int(number)


ASYNC_ORDERS = ("arrival", "fixed")
ASYNC_PUSHES = ("delta", "gradient")
STALENESS_SCALINGS = ("inverse", "none")


@dataclass(frozen=True)
class AsyncConfig:
    order: str = "arrival"  # arrival (whoever finishes first) | fixed (slot order, reproducible)
    max_staleness: int | None = None  # a replica that would be staler than this waits; None = no bound
    staleness_scaling: str = "inverse"  # inverse: an update counts 1/(1 + staleness) | none
    push: str = "delta"  # delta: H local steps, push new - pulled | gradient: one gradient
    replay_updates: str | None = None  # an arrival run's updates.jsonl: apply in its order

    def validate(self) -> None:
        _check_types(self, "asynchronous.")
        _check(self.order in ASYNC_ORDERS, "asynchronous.order", f"must be one of {ASYNC_ORDERS}",
               self.order)
        _check(self.max_staleness is None or self.max_staleness >= 0,
               "asynchronous.max_staleness", "must be >= 0", self.max_staleness)
        _check(self.staleness_scaling in STALENESS_SCALINGS, "asynchronous.staleness_scaling",
               f"must be one of {STALENESS_SCALINGS}", self.staleness_scaling)
        _check(self.push in ASYNC_PUSHES, "asynchronous.push", f"must be one of {ASYNC_PUSHES}",
               self.push)


@dataclass(frozen=True)
class ClusterConfig:
    scheduler: str | None = None  # address of a running `dask scheduler`; None = own LocalCluster
    workers: int | None = None  # LocalCluster workers; None = sized for the machine
    threads_per_worker: int = 1  # LocalCluster threads per worker (= BLAS threads per task)
    dashboard_address: str = "127.0.0.1:8787"  # LocalCluster dashboard HOST:PORT; a busy port
    #                                             falls back to a free one; port 0 = any free port
    tls_ca_file: str | None = None  # TLS: CA certificate that signed scheduler and workers
    tls_cert: str | None = None  # TLS: this client's certificate
    tls_key: str | None = None  # TLS: this client's private key
    connect_timeout: float = 10.0  # seconds to wait for the scheduler before giving up
    resource_timeout: float = 5.0  # seconds to wait for a worker with a needed resource
    pin_replicas: bool = True  # replica k's train- tasks prefer worker k mod W (sorted by name;
    #                            beside workers without the train resource: asking for the
    #                            RANK-i resource of a ranked worker), as a rank stays on its GPU;
    #                            off: the scheduler places them (it stacks replicas on one
    #                            worker in some rounds: placement.py)
    gpu_workers_per_device: int = 1  # LocalCluster GPU worker processes per device (replicas
    #                                  share the device by time-slicing; benchmarks/gpu.py)
    gpu_threads: int = 1  # LocalCluster threads per GPU worker (concurrent train- tasks in one
    #                       process and CUDA context)
    loader_workers: int = 0  # LocalCluster one-thread worker processes that only load (decode-,
    #                          augment-); the CPU workers then only train (train.cpu_resource)
    # The stalled-task watchdog (pipeline.cluster.watchdog): a task running stall_report x its peers'
    # median is reported, past stall_retire x the median its worker is retired so the work is
    # replayed elsewhere; neither before it has run stall_min_s seconds. 0 turns retiring off.
    # A task a live worker has not been computing for stall_min_s (a lost assignment, e.g. it
    # never got it) is assigned again.
    stall_report: float = 5.0  # multiple of the peers' median task time
    stall_retire: float = 20.0  # multiple of the peers' median task time; 0 = never retire
    stall_min_s: float = 60.0  # seconds a task may always run, whatever its peers take

    def validate(self) -> None:
        _check_types(self, "cluster.")
        _check(self.workers is None or 1 <= self.workers <= 1024, "cluster.workers",
               "must be in [1, 1024]", self.workers)
        _check(1 <= self.threads_per_worker <= 1024, "cluster.threads_per_worker",
               "must be in [1, 1024]", self.threads_per_worker)
        tls = (self.tls_ca_file, self.tls_cert, self.tls_key)
        _check(all(tls) or not any(tls), "cluster.tls", "needs all of ca file, cert and key", tls)
        _in(self.connect_timeout, 0, DAY_S, "cluster.connect_timeout", closed_lo=False)
        _in(self.resource_timeout, 0, DAY_S, "cluster.resource_timeout")
        _check(1 <= self.gpu_workers_per_device <= 64, "cluster.gpu_workers_per_device",
               "must be in [1, 64]", self.gpu_workers_per_device)
        _check(1 <= self.gpu_threads <= 64, "cluster.gpu_threads", "must be in [1, 64]",
               self.gpu_threads)
        _check(0 <= self.loader_workers <= 1024, "cluster.loader_workers", "must be in [0, 1024]",
               self.loader_workers)
        _in(self.stall_report, 1, 1e6, "cluster.stall_report")
        _check(self.stall_retire == 0 or self.stall_report <= self.stall_retire <= 1e6,
               "cluster.stall_retire", "must be 0 (never) or in [cluster.stall_report, 1e6]",
               self.stall_retire)
        _in(self.stall_min_s, 0, DAY_S, "cluster.stall_min_s")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0  # the run seed; every random stream derives from it (pipeline.core.rng)
    out: str | None = None  # output directory (metrics.jsonl, model.npz, curves.png, checkpoints)
    eval_every: int = 0  # evaluate every N rounds as well as at each epoch end; 0 = epochs only
    checkpoint_every: int = 10  # checkpoint every N rounds (and at the end); 0 = end only
    # At most this many rounds between anchors: where checkpoints are further apart (or off, or
    # there is no --out) the driver also gathers the state every N rounds and restarts from it
    # as a fresh root, unwritten. Bounds what a lost worker replays and the lineage a worker
    # keeps (distributed keeps a released task's record while a task computed from it on that
    # worker is alive: an unbroken chain of rounds grows a worker ~40 KiB a round). 0 = anchors
    # at checkpoints only.
    anchor_every: int = 100
    progress: bool = True  # show a progress bar on stderr
    tensorboard: bool = False  # also write TensorBoard event files to OUT/tensorboard/
    csv: bool = False  # also write the metrics as OUT/metrics.csv (one row per round)

    def validate(self) -> "Config":
        for name in _SECTIONS:
            _check(isinstance(getattr(self, name), _SECTIONS[name]), name,
                   "must be a section (a JSON object)", getattr(self, name))
        for name in _SECTIONS:
            getattr(self, name).validate()
        for f in dataclasses.fields(self):
            if f.name not in _SECTIONS:
                kinds = [k.strip() for k in str(f.type).split("|")]
                _check(any(_is(getattr(self, f.name), k) for k in kinds), f.name,
                       f"must be {' or '.join(_WORDS[k] for k in kinds)}", getattr(self, f.name))
        _check(self.seed >= 0, "seed", "must be >= 0", self.seed)
        _check(self.out is None or self.out != "", "out",
               "must be a directory path (or None for no outputs)", self.out)
        _check(self.eval_every >= 0, "eval_every", "must be >= 0", self.eval_every)
        _check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0", self.checkpoint_every)
        _check(self.anchor_every >= 0, "anchor_every", "must be >= 0", self.anchor_every)
        return self

    def replace(self, **sections) -> "Config":
        """Copy with some fields replaced; dotted names reach into sections.

        >>> Config().replace(**{"train.replicas": 2, "seed": 3}).train.replicas
        2
        """
        top, nested = {}, {}
        for name, value in sections.items():
            if "." in name:
                section, key = name.split(".", 1)
                nested.setdefault(section, {})[key] = value
            else:
                top[name] = value
        for section, values in nested.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A config from its ``to_dict`` form (config.json); ValueError naming the first field
        that is unknown, missing its section or of the wrong type. Validated."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in d.items():
            if name not in names:
                raise ValueError(f"config has unknown field {str(name)[:60]!r}")
            if name in _SECTIONS:
                if not isinstance(value, dict):
                    raise ValueError(f"{name} must be a section (a JSON object), got "
                                     f"{_short(value)}")
                known = {f.name for f in dataclasses.fields(_SECTIONS[name])}
                unknown = [k for k in value if k not in known]
                if unknown:
                    raise ValueError(f"config has unknown field {name}.{str(unknown[0])[:60]}")
                kwargs[name] = _SECTIONS[name](**value)
            else:
                kwargs[name] = value
        return cls(**kwargs).validate()


_SECTIONS = {"data": DataConfig, "augment": AugmentConfig, "model": ModelConfig,
             "train": TrainConfig, "average": AverageConfig, "asynchronous": AsyncConfig,
             "cluster": ClusterConfig}
