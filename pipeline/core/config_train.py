"""The config sections of how it is trained: ``train`` (the strategy, replicas, optimizer and
schedule), ``average`` (ipm's rounds, the averaging algorithm, the outer step) and
``asynchronous`` (async's order, staleness and pushes). The strategy fills the fields of
``Strategy.PLAIN`` left None or "auto" (``pipeline.training.strategies.base``)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.core.fields import (check, check_types, in_range, is_import_path,
                                  is_json_object, opt)

# The names of strategies and averaging algorithms are their registries' (pipeline.training.
# strategies.REGISTRY, pipeline.averaging.algorithms.ALGORITHMS): checked there, so a new one is
# its module plus its registry line; here only their form (core cannot import those packages).
NAME_FORM = re.compile(r"[a-z][a-z0-9_-]{0,39}")
#                                         registers one class per name (a test checks both agree)

OPTIMIZERS = ("sgd", "momentum", "adam")
DEVICES = ("cpu", "gpu", "auto")
PRECISIONS = ("fp32", "bf16")
OPT_STATE_MODES = ("auto", "keep", "reset", "average")
LR_SCALINGS = ("auto", "none", "linear", "sqrt")
LR_DECAYS = ("none", "cosine")
MAX_EPOCHS = 100_000.0
MAX_REPLICAS = 4096  # also what a checkpoint may hold (pipeline.outputs.checkpoint reads it)
_OPTIMIZER = re.compile(r"^[A-Z][A-Za-z0-9_]{0,63}$")  # a class name: chainer.optimizers.RMSprop


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
    optimizer: str = opt("momentum", "the replicas' optimizer: sgd, momentum, adam, any class "
                         "of chainer.optimizers by name (RMSprop, AdaGrad, AdamW, ...), or your "
                         "own factory pkg.module:factory (README, 'Your own model'; named again "
                         "to resume)", flag="--optimizer", metavar="NAME")
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
    precision: str = opt("fp32", "the convolutions' inputs on CPU workers (bf16: rounded to "
                         "bfloat16, products summed in float32 by oneDNN, on a CPU with AMX or "
                         "AVX512-BF16; weights, gradients, BatchNorm, loss and optimizer stay "
                         "float32)", flag="--precision", metavar="KIND", choices=PRECISIONS)

    def validate(self) -> None:
        check_types(self, "train.")
        check(bool(NAME_FORM.fullmatch(self.strategy)), "train.strategy",
              "must be a strategy's name (pipeline.training.strategies.REGISTRY)", self.strategy)
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
        check(self.optimizer in OPTIMIZERS or bool(_OPTIMIZER.match(self.optimizer))
              or is_import_path(self.optimizer), "train.optimizer",
              f"must be one of {OPTIMIZERS}, a class name of chainer.optimizers (RMSprop, "
              f"AdaGrad, ...) or pkg.module:factory",
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
        check(self.precision in PRECISIONS, "train.precision", f"must be one of {PRECISIONS}",
               self.precision)

_MIX_RE = re.compile(r"^(\d{1,9})(ep)?$")  # nine digits: a billion steps is past any plan


@dataclass(frozen=True)
class AverageConfig:
    """As in TrainConfig, the strategy fills the fields of Strategy.PLAIN left None or "auto"."""

    mix_every: str | int = opt("auto", "round length H: 10 = ten local steps, 1ep = one epoch "
                               "(ipm averages after each round; async's delta pushes after H "
                               "steps); auto: the strategy's recipe (ipm with adam: 1 from 8 "
                               "replicas, IPM.SYNC_FROM_K), else 10",
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
    algorithm: str = opt("auto", "how the replicas' state is averaged (auto: on one host gather "
                         "for two workers, else the tree; across hosts the cost model's fastest; "
                         "gather: each worker adds every state itself; sharded: reduce-scatter + "
                         "all-gather; hierarchical: each host adds its own replicas first); all "
                         "give the same bits (pipeline.averaging.algorithms)", flag="--average",
                         metavar="ALGORITHM")
    shards: int = opt(0, "sharded/hierarchical: shards S of the state (0: one per host, one per "
                      "worker on one host)", flag="--shards", metavar="S", unit="shards")
    link_gbps: float = opt(10.0, "link rate between hosts that auto's cost model assumes",
                           flag="--link-gbps", metavar="GBPS", unit="Gb/s")

    def validate(self) -> None:
        check_types(self, "average.")
        match = _MIX_RE.match(str(self.mix_every))
        check(self.mix_every == "auto" or (match is not None and int(match.group(1)) >= 1),
              "average.mix_every", "must be a positive step count like 10, epochs like 1ep or "
              "auto", self.mix_every)
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
        check(bool(NAME_FORM.fullmatch(self.algorithm)), "average.algorithm",
              "must be an algorithm's name (pipeline.averaging.algorithms.ALGORITHMS)",
              self.algorithm)
        in_range(self.shards, 0, 1024, "average.shards")  # tasks per average grow with S
        in_range(self.link_gbps, 0, 10_000, "average.link_gbps", closed_lo=False)

    def period(self, steps_per_epoch: int) -> int:
        """H in local steps: "10" -> 10, "2ep" -> 2 * steps_per_epoch ("auto" is filled by the
        strategy first: ``Policy.resolve``)."""
        if self.mix_every == "auto":
            raise ValueError("average.mix_every is auto: resolve the config with its strategy")
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
