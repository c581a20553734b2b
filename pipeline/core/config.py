"""The run configuration: frozen dataclasses in small sections, each field described once (its
metadata), validated with errors that name the field."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from pipeline.core.fields import WORDS, check, check_types, in_range, is_kind, opt, short

STRATEGIES = ("single", "gradient", "mixture", "ipm", "async")  # pipeline.training.strategies
#                                         registers one class per name (a test checks both agree)

OPTIMIZERS = ("sgd", "momentum", "adam")
DEVICES = ("cpu", "gpu", "auto")
OPT_STATE_MODES = ("auto", "keep", "reset", "average")
LR_SCALINGS = ("auto", "none", "linear", "sqrt")
LR_DECAYS = ("none", "cosine")
CPU_KERNELS = ("ours", "chainer")
AVERAGE_ALGORITHMS = ("auto", "tree", "sharded", "hierarchical")
CACHE_MODES = ("auto", "on", "off")
DATASETS = ("cifar10", "cifar100")
# What a run's data was, as config.json records it (pipeline.data.datasets.KINDS): a CIFAR
# name, or the reader of a source that is no CIFAR (the CIFAR reader never sees those).
RECORDED_DATASETS = DATASETS + ("synthetic", "image-folder", "file-list")
LABEL_KINDS = ("fine", "coarse")


MAX_EPOCHS = 100_000.0
MAX_REPLICAS = 4096  # also what a checkpoint may hold (pipeline.outputs.checkpoint.MAX_REPLICAS)
DAY_S = 86_400.0  # longest timeout: a day
_OPTIMIZER = re.compile(r"^[A-Z][A-Za-z0-9_]{0,63}$")  # a class name: chainer.optimizers.RMSprop
_KERNEL = re.compile(r"^[A-Za-z][A-Za-z0-9_]{1,31}$")  # an OPENBLAS_CORETYPE value


@dataclass(frozen=True)
class DataConfig:
    source: str = opt(
        "synthetic", "training data: synthetic (5,000 train / 1,000 test images made on the "
        "fly), synthetic:N:M (N train / M test images), cifar10, cifar10-binary or cifar100 (the "
        "official archive in the cache), a CIFAR directory or tarball, an image folder "
        "(root/<class>/<image>, optional train/ and val/) or a file list (path label)",
        flag="--data", metavar="SOURCE")
    cache_dir: str | None = opt(None, "where downloads go (also $DASK_CHAINER_CACHE)",
                                none="~/.cache/dask-chainer-pipeline")
    download: bool = opt(False, "fetch the official CIFAR archive (MD5-checked) into the cache "
                         "when it is missing", flag="--download")
    dataset: str = opt("cifar10", "which CIFAR a directory holds or a download fetches (python "
                       "format); config.json records what the data was (cifar10, cifar100, "
                       "synthetic, image-folder or file-list)", choices=DATASETS)
    label_kind: str = opt("fine", "CIFAR-100 only: fine (100 classes) or coarse (20) labels",
                          choices=LABEL_KINDS)
    image_size: int | None = opt(
        None, "image folders/lists: side of the square images the model sees, 16 to 1024 (CIFAR "
        "is always 32)", flag="--image-size", metavar="PIXELS", unit="pixels",
        none="the readers' default (pipeline.data.images.DEFAULT_SIZE)")
    val_fraction: float = opt(0.1, "image folders/lists without val/: share of each class held "
                              "out for val by a seeded split (data.split_seed)",
                              flag="--val-fraction", metavar="F")
    val_source: str | None = opt(None, "image folders/lists: a folder or file list to use as the "
                                 "val split", flag="--val-data", metavar="SOURCE",
                                 none="val/, else the --val-fraction held out")
    image_root: str | None = opt(None, "file lists: where relative paths start",
                                 flag="--image-root", metavar="DIR", none="the list's directory")
    split_seed: int = opt(0, "seed of the held-out val split (a property of the data, not the "
                          "run)")
    cache: str = opt("auto", "keep decoded training images on the workers (auto: when they take "
                     "at most a quarter of the smallest worker's memory; otherwise each round "
                     "decodes its shard again)", flag="--cache", metavar="MODE",
                     choices=CACHE_MODES)
    max_pixels: int = opt(1 << 26, "images with more pixels (width x height) are refused",
                          unit="pixels")
    decode_chunk: int = opt(128, "images per scan- / decode- task", unit="images")

    def validate(self) -> None:
        check_types(self, "data.")
        check(bool(self.source), "data.source", "must not be empty", self.source)
        check(self.image_size is None or 16 <= self.image_size <= 1024, "data.image_size",
               "must be in [16, 1024] pixels", self.image_size)
        check(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)",
               self.val_fraction)
        check(self.split_seed >= 0, "data.split_seed", "must be >= 0", self.split_seed)
        check(self.cache in CACHE_MODES, "data.cache", "must be auto, on or off",
               self.cache)
        check(self.max_pixels >= 1, "data.max_pixels", "must be >= 1", self.max_pixels)
        check(self.decode_chunk >= 1, "data.decode_chunk", "must be >= 1", self.decode_chunk)
        check(self.dataset in RECORDED_DATASETS, "data.dataset", "must be cifar10 or cifar100 "
              "(or, as config.json records it, synthetic, image-folder or file-list)",
              self.dataset)
        check(self.label_kind in LABEL_KINDS, "data.label_kind", "must be fine or coarse",
               self.label_kind)


@dataclass(frozen=True)
class AugmentConfig:
    policy: str = opt("cifar", "augmentation of the training images (cifar: pad, crop and flip; "
                      "cifar-cutout: and cutout; resized-crop: torchvision's RandomResizedCrop "
                      "and flip, for image folders)", flag="--augment", metavar="POLICY")
    chunk: int = opt(1000, "images per augment- seed chunk (global index ranges, not per worker)",
                     unit="images")
    resource: str = opt("CPU", "worker resource that augment- tasks ask for when a worker "
                        "advertises it")
    prefetch: int = opt(1, "rounds of augmentation computed ahead of training (memory: depth x "
                        "shard)", flag="--prefetch", metavar="N", unit="rounds")

    def validate(self) -> None:
        check_types(self, "augment.")
        check(self.chunk >= 1, "augment.chunk", "must be >= 1", self.chunk)
        check(self.prefetch >= 0, "augment.prefetch", "must be >= 0", self.prefetch)
        check(self.prefetch <= 100, "augment.prefetch", "must be <= 100 (rounds held ahead)",
               self.prefetch)


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt("small-cnn", "the model (small-cnn: 15 k parameters, fast on a CPU; "
                    "wide-mlp: a 100.9 MB state for communication experiments; resnet50, vgg16, "
                    "googlenet: Chainer's architectures, random init, a fresh head), or your own: "
                    "pkg.module:factory, a class or callable returning a chainer.Link (README, "
                    "'Your own model'); config.json records it, and a resume or evaluate of the "
                    "run needs it named again", flag="--model", metavar="NAME")
    args: str = opt("{}", "keyword arguments of a pkg.module:factory model, a JSON object "
                    "(n_classes= is passed too when the factory names that parameter)",
                    flag="--model-args", metavar="JSON")
    init_weights: str | None = opt(None, "start from the weights in this .npz (a model.npz or "
                                   "Chainer's save_npz of the same model; read without "
                                   "unpickling, every name, shape and dtype checked)",
                                   flag="--init-weights", metavar="NPZ", none="the run seed's")
    n_classes: int = opt(10, "output units; taken from the data when it says otherwise")
    input_size: int = opt(0, "side of the square images the model was built at (a run records "
                          "the data's; 0: not recorded): evaluate and load_model rebuild a "
                          "model with lazily sized parameters there")
    cpu_kernels: str = opt("ours", "what runs convolution, pooling and BatchNorm on CPU workers "
                           "(ours: the NumPy kernels of pipeline.backends.chainer.cpu_kernels, "
                           "2.9-3.7x faster per step at batch 100, docs/benchmarks.md; chainer: "
                           "Chainer's functions, which GPU workers always run)",
                           flag="--cpu-kernels", metavar="KIND", choices=CPU_KERNELS)

    def validate(self) -> None:
        check_types(self, "model.")
        in_range(self.n_classes, 2, 100_000, "model.n_classes")
        in_range(self.input_size, 0, 1 << 16, "model.input_size")
        check(is_json_object(self.args), "model.args", "must be a JSON object", self.args)
        check(self.init_weights is None or self.init_weights != "", "model.init_weights",
               "must be a .npz path", self.init_weights)
        check(self.cpu_kernels in CPU_KERNELS, "model.cpu_kernels",
               f"must be one of {CPU_KERNELS}", self.cpu_kernels)


@dataclass(frozen=True)
class TrainConfig:
    """Fields listed in ``Strategy.PLAIN`` (pipeline.training.strategies.base) left None or
    "auto" are filled by the strategy: its recipe, else the plain values."""

    strategy: str = opt("ipm", "how the replicas work together (single: one replica; gradient: "
                        "one step on their mean gradient; mixture: averaged once, at the end; "
                        "ipm: averaged every round; async: no barrier, each replica's update "
                        "applied as it arrives; docs/strategies.md)", flag="--strategy",
                        metavar="NAME")
    replicas: int = opt(4, "K model replicas trained side by side, by any number of workers",
                        flag="--replicas", metavar="K", unit="replicas")
    epochs: float = opt(2.0, "passes over the training set (fractions allowed); with --resume, "
                        "the run trains on to this many", flag="--epochs", metavar="E",
                        unit="epochs")
    batch_size: int = opt(64, "images per replica per step (B); gradient's global batch is K x B",
                          flag="--batch-size", metavar="B", unit="images")
    optimizer: str = opt("momentum", "the replicas' optimizer: sgd, momentum, adam, or any "
                         "class of chainer.optimizers by name (RMSprop, AdaGrad, AdamW, ...)",
                         flag="--optimizer", metavar="NAME")
    optimizer_args: str = opt("{}", "keyword arguments of the optimizer, a JSON object (its "
                              "learning rate is --lr)", flag="--optimizer-args", metavar="JSON")
    lr: float = opt(0.01, "learning rate of each replica (adam: alpha), before scaling and "
                    "warmup; small-cnn with momentum learns at 0.01 to 0.02, not at 0.05",
                    flag="--lr", metavar="LR")
    momentum: float = opt(0.9, "momentum of the momentum optimizer", flag="--momentum",
                          metavar="M")
    weight_decay: float = opt(0.0, "L2 penalty coefficient, applied by the optimizer",
                              flag="--weight-decay", metavar="WD")
    grad_clip: float = opt(0.0, "rescale the gradient to this L2 norm when it is longer "
                           "(Chainer's GradientClipping hook; 0: off)", flag="--grad-clip",
                           metavar="NORM")
    beta1: float | None = opt(None, "Adam's first-moment decay", flag="--beta1", metavar="B")
    beta2: float | None = opt(None, "Adam's second-moment decay", flag="--beta2", metavar="B")
    adam_eps: float | None = opt(None, "Adam's epsilon", flag="--adam-eps", metavar="EPS")
    lr_scaling: str = opt("auto", "multiply the lr by K (linear) or sqrt(K) (sqrt), for large "
                          "global batches (Goyal et al. 2017)",
                          flag="--lr-scaling", metavar="RULE", choices=LR_SCALINGS)
    warmup_epochs: float | None = opt(None, "raise the learning rate linearly to the lr over the "
                                      "first this many epochs", flag="--warmup-epochs",
                                      metavar="E", unit="epochs")
    lr_decay: str = opt("none", "after the warmup, lower the learning rate along a half cosine "
                        "to 0 at train.epochs (the horizon: --resume --epochs moves it)",
                        flag="--lr-decay", metavar="SCHEDULE", choices=LR_DECAYS)
    recipe: bool = opt(True, "fill the settings left open with the strategy's scale-out recipe "
                       "(docs/strategies.md), else with their plain values; settings given "
                       "explicitly always win", flag="--recipe")
    device: str = opt("cpu", "where train- tasks run (auto: gpu when a worker advertises "
                      "--gpu-resource)", flag="--device", metavar="NAME", choices=DEVICES)
    gpu_resource: str = opt("GPU", "worker resource that GPU train- tasks ask for",
                            flag="--gpu-resource", metavar="NAME")
    cpu_resource: str = opt("TRAIN", "worker resource that CPU train- and evaluate- tasks ask for "
                            "when a worker advertises it (training workers beside loader "
                            "workers)", flag="--cpu-resource", metavar="NAME")
    tta: bool = opt(False, "evaluate with test-time augmentation (flips and shifted crops)",
                    flag="--tta")

    def validate(self) -> None:
        check_types(self, "train.")
        check(self.strategy in STRATEGIES, "train.strategy", f"must be one of {STRATEGIES}",
               self.strategy)
        check(self.replicas >= 1, "train.replicas", "must be >= 1", self.replicas)
        check(self.replicas <= MAX_REPLICAS, "train.replicas", f"must be <= {MAX_REPLICAS}",
               self.replicas)
        check(self.strategy != "single" or self.replicas == 1, "train.replicas",
               "must be 1 for strategy single", self.replicas)
        check(self.epochs > 0, "train.epochs", "must be > 0", self.epochs)
        check(self.epochs <= MAX_EPOCHS, "train.epochs", f"must be <= {MAX_EPOCHS:g}",
               self.epochs)
        check(self.batch_size >= 1, "train.batch_size", "must be >= 1", self.batch_size)
        check(self.batch_size <= 1 << 20, "train.batch_size", "must be <= 1048576",
               self.batch_size)
        check(self.optimizer in OPTIMIZERS or bool(_OPTIMIZER.match(self.optimizer)),
               "train.optimizer", f"must be one of {OPTIMIZERS} or a class name of "
               f"chainer.optimizers (RMSprop, AdaGrad, ...)",
               self.optimizer)
        check(is_json_object(self.optimizer_args), "train.optimizer_args",
               "must be a JSON object", self.optimizer_args)
        check(self.grad_clip >= 0, "train.grad_clip", "must be >= 0", self.grad_clip)
        check(self.lr > 0, "train.lr", "must be > 0", self.lr)
        check(0 <= self.momentum < 1, "train.momentum", "must be in [0, 1)", self.momentum)
        check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            check(value is None or 0 <= value < 1, f"train.{name}", "must be in [0, 1)", value)
        check(self.adam_eps is None or self.adam_eps > 0, "train.adam_eps", "must be > 0",
               self.adam_eps)
        check(self.lr_scaling in LR_SCALINGS, "train.lr_scaling", f"must be one of {LR_SCALINGS}",
               self.lr_scaling)
        check(self.lr_decay in LR_DECAYS, "train.lr_decay", f"must be one of {LR_DECAYS}",
               self.lr_decay)
        check(self.warmup_epochs is None or self.warmup_epochs >= 0, "train.warmup_epochs",
               "must be >= 0", self.warmup_epochs)
        check(self.device in DEVICES, "train.device", f"must be one of {DEVICES}", self.device)


def is_json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object (the form of --model-args and --optimizer-args).

    >>> is_json_object('{"width": 2}'), is_json_object("[1]"), is_json_object("{")
    (True, False, False)
    """
    try:
        return isinstance(json.loads(text), dict) and len(text) <= 100_000
    except (ValueError, RecursionError):
        return False


_MIX_RE = re.compile(r"^(\d{1,9})(ep)?$")  # nine digits: a billion steps is past any plan


@dataclass(frozen=True)
class AverageConfig:
    """As in TrainConfig, the strategy fills the fields of Strategy.PLAIN left None or "auto"."""

    mix_every: str | int = opt("10", "round length H: 10 = ten local steps, 1ep = one epoch (ipm "
                               "averages after each round; async's delta pushes after H steps)",
                               flag="--mix-every", metavar="H", unit="steps")
    # Fewer levels move fewer float64 partial sums (benchmarks/averaging.py).
    fan_in: int = opt(4, "inputs per average- task of the reduction tree (dask's split_every)",
                      flag="--fan-in", metavar="N", unit="inputs")
    outer_lr: float | None = opt(None, "ipm: outer learning rate on the averaged update, as in "
                                 "DiLoCo (1: plain averaging)", flag="--outer-lr", metavar="LR")
    outer_momentum: float = opt(0.0, "ipm: outer Nesterov momentum, as in DiLoCo (0: plain "
                                "averaging)", flag="--outer-momentum", metavar="M")
    outer_warmup_epochs: float | None = opt(None, "ipm: the outer lr ramps from 1 to the outer lr "
                                            "over the first this many epochs",
                                            flag="--outer-warmup-epochs", metavar="E",
                                            unit="epochs")
    adaptive_outer: bool | None = opt(None, "ipm: multiply the outer lr by the replicas' "
                                      "AdaScale gain (1..K)", flag="--adaptive-outer")
    optimizer_state: str = opt("auto", "what ipm does with the replicas' optimizer state at an "
                               "average", flag="--optimizer-state", metavar="MODE",
                               choices=OPT_STATE_MODES)
    algorithm: str = opt("auto", "how the replicas' state is averaged (auto: the tree on one "
                         "host, the cost model's fastest across hosts; sharded: reduce-scatter + "
                         "all-gather; hierarchical: each host adds its own replicas first); all "
                         "give the same bits (pipeline.averaging.algorithms)", flag="--average",
                         metavar="ALGORITHM", choices=AVERAGE_ALGORITHMS)
    shards: int = opt(0, "sharded/hierarchical: shards S of the state (0: one per host, one per "
                      "worker on one host)", flag="--shards", metavar="S", unit="shards")
    link_gbps: float = opt(10.0, "link rate between hosts that auto's cost model assumes",
                           flag="--link-gbps", metavar="GBPS", unit="Gb/s")

    def validate(self) -> None:
        check_types(self, "average.")
        match = _MIX_RE.match(str(self.mix_every))
        check(match is not None and int(match.group(1)) >= 1, "average.mix_every",
               "must be a positive step count like 10 or epochs like 1ep", self.mix_every)
        check(self.fan_in >= 2, "average.fan_in", "must be >= 2", self.fan_in)
        check(self.fan_in <= 1024, "average.fan_in", "must be <= 1024", self.fan_in)
        check(self.outer_lr is None or self.outer_lr > 0, "average.outer_lr", "must be > 0",
               self.outer_lr)
        check(self.outer_warmup_epochs is None or 0 <= self.outer_warmup_epochs <= MAX_EPOCHS,
               "average.outer_warmup_epochs", f"must be in [0, {MAX_EPOCHS:g}]",
               self.outer_warmup_epochs)
        check(0 <= self.outer_momentum < 1, "average.outer_momentum", "must be in [0, 1)",
               self.outer_momentum)
        check(self.optimizer_state in OPT_STATE_MODES, "average.optimizer_state",
               f"must be one of {OPT_STATE_MODES}", self.optimizer_state)
        check(self.algorithm in AVERAGE_ALGORITHMS, "average.algorithm",
               f"must be one of {AVERAGE_ALGORITHMS}", self.algorithm)
        in_range(self.shards, 0, 1024, "average.shards")  # tasks per average grow with S
        in_range(self.link_gbps, 0, 10_000, "average.link_gbps", closed_lo=False)

    def period(self, steps_per_epoch: int) -> int:
        """H in local steps: "10" -> 10, "2ep" -> 2 * steps_per_epoch."""
        number, epochs = _MIX_RE.match(str(self.mix_every)).groups()
        return int(number) * steps_per_epoch if epochs else int(number)


ASYNC_ORDERS = ("arrival", "fixed")
ASYNC_PUSHES = ("delta", "gradient")
STALENESS_SCALINGS = ("inverse", "none")


@dataclass(frozen=True)
class AsyncConfig:
    order: str = opt("arrival", "the order async applies updates in (arrival: whoever finishes "
                     "first; fixed: slot order, the same weights on any number of workers)",
                     flag="--async-order", metavar="ORDER", choices=ASYNC_ORDERS)
    max_staleness: int | None = opt(None, "async: an update waits while applying it would leave "
                                    "another replica more than S updates behind (S >= K - 1)",
                                    flag="--max-staleness", metavar="S", none="no bound")
    staleness_scaling: str = opt("inverse", "what a stale async update counts (inverse: 1/(1 + "
                                 "staleness); none: fully)", flag="--staleness-scaling",
                                 metavar="RULE", choices=STALENESS_SCALINGS)
    push: str = opt("delta", "what an async replica pushes (delta: H local steps, new - pulled; "
                    "gradient: one gradient, the apply- task takes the optimizer step)",
                    flag="--async-push", metavar="WHAT", choices=ASYNC_PUSHES)
    replay_updates: str | None = opt(None, "async: apply updates in the order an arrival run "
                                     "logged to OUT/updates.jsonl (reproduces it byte for byte)",
                                     flag="--replay-updates", metavar="FILE")

    def validate(self) -> None:
        check_types(self, "asynchronous.")
        check(self.order in ASYNC_ORDERS, "asynchronous.order", f"must be one of {ASYNC_ORDERS}",
               self.order)
        check(self.max_staleness is None or self.max_staleness >= 0,
               "asynchronous.max_staleness", "must be >= 0", self.max_staleness)
        check(self.staleness_scaling in STALENESS_SCALINGS, "asynchronous.staleness_scaling",
               f"must be one of {STALENESS_SCALINGS}", self.staleness_scaling)
        check(self.push in ASYNC_PUSHES, "asynchronous.push", f"must be one of {ASYNC_PUSHES}",
               self.push)


def dashboard_port(address: str) -> int | None:
    """The port of a dashboard address (``HOST:PORT``, ``:PORT``, ``PORT``, ``[v6]:PORT``), or
    None when it has none in [0, 65535].

    >>> dashboard_port("127.0.0.1:8787"), dashboard_port(":0"), dashboard_port(":99999")
    (8787, 0, None)
    """
    if not isinstance(address, str):
        return None
    port = address.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and len(port) <= 5):
        return None
    return int(port) if int(port) <= 65535 else None


@dataclass(frozen=True)
class ClusterConfig:
    scheduler: str | None = opt(None, "a running dask scheduler (tcp://HOST:PORT) instead of a "
                                "local cluster; also $DASK_SCHEDULER_ADDRESS", flag="--scheduler",
                                metavar="ADDRESS", none="none: a local cluster")
    workers: int | None = opt(None, "local cluster: CPU worker processes", flag="--workers",
                              metavar="N", none="the cores that GPU and loader workers leave, "
                              "over --threads-per-worker")
    threads_per_worker: int = opt(1, "local cluster: threads per worker process (= BLAS threads "
                                  "per task)", flag="--threads-per-worker", metavar="N",
                                  unit="threads")
    dashboard_address: str = opt("127.0.0.1:8787", "local cluster: where its dashboard listens "
                                 "(port 0: any free port; a busy port falls back to a free one)",
                                 flag="--dashboard-address", metavar="HOST:PORT")
    tls_ca_file: str | None = opt(None, "TLS: CA certificate that signed the scheduler and "
                                  "workers", flag="--tls-ca-file", metavar="PEM")
    tls_cert: str | None = opt(None, "TLS: this client's certificate", flag="--tls-cert",
                               metavar="PEM")
    tls_key: str | None = opt(None, "TLS: this client's private key", flag="--tls-key",
                              metavar="PEM")
    connect_timeout: float = opt(10.0, "how long to wait for the scheduler and its workers",
                                 flag="--connect-timeout", metavar="SECONDS", unit="s")
    resource_timeout: float = opt(5.0, "how long to wait for a worker with a needed resource",
                                  unit="s")
    # Unpinned, the scheduler stacks replicas on one worker in some rounds (placement.py).
    pin_replicas: bool = opt(True, "replica k's train- tasks prefer worker k mod W (sorted by "
                             "name; beside loader or CPU workers, by the RANK-i resource of a "
                             "ranked worker), as a rank stays on its device; off: the scheduler "
                             "places them", flag="--pin-replicas")
    gpu_workers_per_device: int = opt(1, "local cluster: GPU worker processes per device (the "
                                      "replicas share it by time-slicing; benchmarks/gpu.py)",
                                      flag="--gpu-workers-per-device", metavar="N",
                                      unit="workers")
    gpu_threads: int = opt(1, "local cluster: threads per GPU worker (concurrent train- tasks in "
                           "one process and CUDA context)", flag="--gpu-threads", metavar="N",
                           unit="threads")
    loader_workers: int = opt(0, "local cluster: one-thread worker processes that only decode "
                              "and augment; the CPU workers then only train "
                              "(--cpu-resource)", flag="--loader-workers", metavar="N",
                              unit="workers")
    # OpenBLAS kernels add in different orders: other bits on another kind of CPU
    # (docs/reliability.md); pipeline.cluster.blas.
    blas_kernel: str | None = opt(None, "OpenBLAS kernel every worker runs (OPENBLAS_CORETYPE: "
                                  "Haswell, SkylakeX, Sandybridge, Zen, ...), so a cluster of "
                                  "mixed CPUs gives one answer: the local cluster's workers "
                                  "start with it, an external cluster's nannies restart theirs",
                                  flag="--blas-kernel", metavar="KERNEL",
                                  none="each worker's own; a warning when they differ")
    # The stalled-task watchdog: pipeline.cluster.watchdog.
    stall_report: float = opt(5.0, "report a task running X times its finished peers' median "
                              "(and at least --stall-min-seconds)", flag="--stall-report",
                              metavar="X", unit="x")
    stall_retire: float = opt(20.0, "retire the worker of a task running X times its peers' "
                              "median, so its work is replayed elsewhere (0: never)",
                              flag="--stall-retire", metavar="X", unit="x")
    stall_min_s: float = opt(60.0, "a task may always run this long before it is reported "
                             "(--stall-retire / --stall-report times as long before its worker is "
                             "retired); a task its worker is not computing is assigned again "
                             "after this long", flag="--stall-min-seconds", metavar="SECONDS",
                             unit="s")

    def validate(self) -> None:
        check_types(self, "cluster.")
        check(self.workers is None or 1 <= self.workers <= 1024, "cluster.workers",
               "must be in [1, 1024]", self.workers)
        check(1 <= self.threads_per_worker <= 1024, "cluster.threads_per_worker",
               "must be in [1, 1024]", self.threads_per_worker)
        tls = (self.tls_ca_file, self.tls_cert, self.tls_key)
        check(all(tls) or not any(tls), "cluster.tls", "needs all of ca file, cert and key", tls)
        in_range(self.connect_timeout, 0, DAY_S, "cluster.connect_timeout", closed_lo=False)
        in_range(self.resource_timeout, 0, DAY_S, "cluster.resource_timeout")
        check(1 <= self.gpu_workers_per_device <= 64, "cluster.gpu_workers_per_device",
               "must be in [1, 64]", self.gpu_workers_per_device)
        check(1 <= self.gpu_threads <= 64, "cluster.gpu_threads", "must be in [1, 64]",
               self.gpu_threads)
        check(0 <= self.loader_workers <= 1024, "cluster.loader_workers", "must be in [0, 1024]",
               self.loader_workers)
        in_range(self.stall_report, 1, 1e6, "cluster.stall_report")
        check(self.stall_retire == 0 or self.stall_report <= self.stall_retire <= 1e6,
               "cluster.stall_retire", "must be 0 (never) or in [cluster.stall_report, 1e6]",
               self.stall_retire)
        in_range(self.stall_min_s, 0, DAY_S, "cluster.stall_min_s")
        check(dashboard_port(self.dashboard_address) is not None, "cluster.dashboard_address",
              "must be HOST:PORT, :PORT or PORT with a port in [0, 65535] (0: any free port)",
              self.dashboard_address)
        check(self.blas_kernel is None or bool(_KERNEL.match(self.blas_kernel)),
              "cluster.blas_kernel", "must be an OpenBLAS kernel name (Haswell, SkylakeX, ...)",
              self.blas_kernel)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = opt(0, "run seed: every random stream derives from it (pipeline.core.rng)",
                    flag="--seed", metavar="N")
    out: str | None = opt(None, "output directory (metrics.jsonl, model.npz, curves.png, "
                          "checkpoints/)", none="no outputs")
    eval_every: int = opt(0, "evaluate on the test set every N rounds as well as at each epoch's "
                          "end (0: epoch ends only)", flag="--eval-every", metavar="N",
                          unit="rounds")
    checkpoint_every: int = opt(10, "write a checkpoint every N rounds and at the end (0: at the "
                                "end only)", flag="--checkpoint-every", metavar="N",
                                unit="rounds")
    # Distributed keeps a released task's record while a task computed from it on that worker is
    # alive: an unbroken chain of rounds grows a worker ~40 KiB a round.
    anchor_every: int = opt(100, "at most N rounds between anchors: where checkpoints are further "
                            "apart (or off, or there is no output directory) the state is also "
                            "gathered every N rounds, unwritten, and the run goes on from it as "
                            "a fresh root, which bounds what a lost worker replays and what the "
                            "workers keep (0: at checkpoints only)", flag="--anchor-every",
                            metavar="N", unit="rounds")
    progress: bool = opt(True, "show a progress bar on stderr", flag="--progress")
    tensorboard: bool = opt(False, "also write TensorBoard event files to OUT/tensorboard/",
                            flag="--tensorboard")
    csv: bool = opt(False, "also write the metrics as OUT/metrics.csv (one row per round)",
                    flag="--csv")

    def validate(self) -> "Config":
        for name in _SECTIONS:
            check(isinstance(getattr(self, name), _SECTIONS[name]), name,
                   "must be a section (a JSON object)", getattr(self, name))
        for name in _SECTIONS:
            getattr(self, name).validate()
        for f in dataclasses.fields(self):
            if f.name not in _SECTIONS:
                kinds = [k.strip() for k in str(f.type).split("|")]
                check(any(is_kind(getattr(self, f.name), k) for k in kinds), f.name,
                       f"must be {' or '.join(WORDS[k] for k in kinds)}", getattr(self, f.name))
        check(self.seed >= 0, "seed", "must be >= 0", self.seed)
        check(self.out is None or self.out != "", "out",
               "must be a directory path (or None for no outputs)", self.out)
        check(self.eval_every >= 0, "eval_every", "must be >= 0", self.eval_every)
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0",
               self.checkpoint_every)
        check(self.anchor_every >= 0, "anchor_every", "must be >= 0", self.anchor_every)
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
                                     f"{short(value)}")
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
