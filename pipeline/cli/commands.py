"""CLI subcommands that run training: train, evaluate, demo."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.core.config import Config
from pipeline.core.errors import UsageError

# --flag, dotted config field, type, metavar, help, unit of the default. argparse leaves unset
# options None, so a resume can tell them apart from the saved config's values; the defaults shown
# in --help are read from Config().
_TRAIN_OPTIONS = [
    ("--data", "data.source", str, "SOURCE", "training data: synthetic (5,000 train / 1,000 test "
     "images made on the fly), synthetic:N:M, cifar10 (the official archive in the cache), a "
     "CIFAR directory or tarball, an image folder (root/<class>/<image>, optional train/ and "
     "val/) or a file list (path label)", ""),
    ("--image-size", "data.image_size", int, "PIXELS", "image folders/lists: side of the square "
     "images the model sees", ""),
    ("--val-fraction", "data.val_fraction", float, "F", "image folders/lists without val/: share "
     "of each class held out", ""),
    ("--val-data", "data.val_source", str, "SOURCE", "image folders/lists: a folder or file list "
     "as the val split", ""),
    ("--image-root", "data.image_root", str, "DIR", "file lists: where relative paths start", ""),
    ("--cache", "data.cache", str, "MODE", "keep decoded images on the workers: auto (if they "
     "fit) | on | off", ""),
    ("--model", "model.name", str, "NAME", "small-cnn (15 k parameters, fast on a CPU) | resnet20 "
     "| cifar10-2015 | wide-mlp (a 100.9 MB state for communication experiments)", ""),
    ("--cpu-kernels", "model.cpu_kernels", str, "KIND", "ours | chainer: convolution, pooling "
     "and BatchNorm on CPU workers by our NumPy kernels or Chainer's functions", ""),
    ("--strategy", "train.strategy", str, "NAME", "single (one replica) | gradient (one step on "
     "the replicas' summed gradients) | mixture (replicas averaged once, at the end) | ipm "
     "(replicas averaged every round) | async (no barrier: each replica's update applied as it "
     "arrives; docs/strategies.md)", ""),
    ("--replicas", "train.replicas", int, "K", "model replicas trained side by side (any number "
     "of workers runs them)", "replicas"),
    ("--mix-every", "average.mix_every", str, "H", "ipm round length: H local steps (10) or H "
     "epochs (1ep) between averages", "steps"),
    ("--epochs", "train.epochs", float, "E", "passes over the training set (fractions allowed); "
     "with --resume, trains the run on to E epochs", "epochs"),
    ("--batch-size", "train.batch_size", int, "B", "images per replica per step", "images"),
    ("--optimizer", "train.optimizer", str, "NAME", "sgd | momentum | adam", ""),
    ("--lr", "train.lr", float, "LR", "learning rate of each replica (adam: alpha); small-cnn "
     "with momentum learns at 0.01 to 0.02, not at 0.05", ""),
    ("--momentum", "train.momentum", float, "M", "momentum of --optimizer momentum", ""),
    ("--weight-decay", "train.weight_decay", float, "WD", "L2 penalty coefficient", ""),
    ("--lr-scaling", "train.lr_scaling", str, "RULE", "none | linear | sqrt: multiply --lr by K "
     "or sqrt(K), for large global batches", ""),
    ("--warmup-epochs", "train.warmup_epochs", float, "E", "raise the learning rate linearly to "
     "--lr over the first E epochs", "epochs"),
    ("--lr-decay", "train.lr_decay", str, "SCHEDULE", "none | cosine: after the warmup, lower "
     "the learning rate along a half cosine to 0 at --epochs", ""),
    ("--outer-lr", "average.outer_lr", float, "LR", "ipm: outer learning rate on the averaged "
     "update (1: plain averaging)", ""),
    ("--outer-momentum", "average.outer_momentum", float, "M", "ipm: outer Nesterov momentum, as "
     "in DiLoCo (0: plain averaging)", ""),
    ("--optimizer-state", "average.optimizer_state", str, "MODE", "ipm: keep | reset | average "
     "each replica's optimizer state at an average", ""),
    ("--fan-in", "average.fan_in", int, "N", "inputs per average- task of the averaging tree",
     "inputs"),
    ("--average", "average.algorithm", str, "ALGORITHM", "auto (the tree on one host, the cost "
     "model's fastest across hosts) | tree | sharded (reduce-scatter + all-gather) | hierarchical "
     "(each host adds its own replicas first); all give the same bits", ""),
    ("--shards", "average.shards", int, "S", "sharded/hierarchical: shards of the state (0: one "
     "per host, one per worker on one host)", "shards"),
    ("--link-gbps", "average.link_gbps", float, "GBPS", "link rate between hosts that --average "
     "auto's cost model assumes", "Gb/s"),
    ("--augment", "augment.policy", str, "POLICY", "none | flip | cifar (pad-crop and flip) | "
     "cifar-cutout | resized-crop (image folders)", ""),
    ("--beta1", "train.beta1", float, "B", "Adam's first-moment decay", ""),
    ("--beta2", "train.beta2", float, "B", "Adam's second-moment decay", ""),
    ("--adam-eps", "train.adam_eps", float, "EPS", "Adam's epsilon", ""),
    ("--outer-warmup-epochs", "average.outer_warmup_epochs", float, "E", "ipm: the outer lr "
     "ramps from 1 to --outer-lr over the first E epochs", "epochs"),
    ("--async-order", "asynchronous.order", str, "ORDER", "async: arrival (whoever finishes "
     "first) | fixed (slot order: the same weights on any number of workers)", ""),
    ("--max-staleness", "asynchronous.max_staleness", int, "S", "async: an update waits while "
     "applying it would leave another replica more than S updates behind (>= K-1)", ""),
    ("--staleness-scaling", "asynchronous.staleness_scaling", str, "RULE", "async: inverse (an "
     "update counts 1/(1 + staleness)) | none", ""),
    ("--async-push", "asynchronous.push", str, "WHAT", "async: delta (H local steps, push new - "
     "pulled) | gradient (one gradient; the apply- task takes the optimizer step)", ""),
    ("--replay-updates", "asynchronous.replay_updates", str, "FILE", "async: apply updates in "
     "the order an arrival run logged to OUT/updates.jsonl (reproduces it byte for byte)", ""),
    ("--prefetch", "augment.prefetch", int, "N", "rounds of augmentation computed ahead of "
     "training", "rounds"),
    ("--seed", "seed", int, "N", "run seed: every random choice derives from it", ""),
    ("--checkpoint-every", "checkpoint_every", int, "N", "write a checkpoint every N rounds and at "
     "the end (0: at the end only)", "rounds"),
    ("--anchor-every", "anchor_every", int, "N", "at most N rounds between anchors: also gather "
     "the state every N rounds between checkpoints (unwritten) and go on from it as a fresh root, "
     "which bounds what a lost worker replays and what the workers keep (0: at checkpoints "
     "only)", "rounds"),
    ("--eval-every", "eval_every", int, "N", "evaluate on the test set every N rounds as well as "
     "at each epoch's end (0: epoch ends only)", "rounds"),
    ("--device", "train.device", str, "NAME", "cpu | gpu | auto (gpu when a worker advertises "
     "--gpu-resource)", ""),
    ("--gpu-resource", "train.gpu_resource", str, "NAME", "worker resource that GPU tasks ask "
     "for", ""),
    ("--cpu-resource", "train.cpu_resource", str, "NAME", "worker resource that CPU train and "
     "evaluate tasks ask for when a worker advertises it (dedicated training workers)", ""),
    ("--loader-workers", "cluster.loader_workers", int, "N", "local cluster: one-thread worker "
     "processes that only decode and augment; the CPU workers then only train", "workers"),
    ("--gpu-workers-per-device", "cluster.gpu_workers_per_device", int, "N", "local cluster: GPU "
     "worker processes per device", "workers"),
    ("--gpu-threads", "cluster.gpu_threads", int, "N", "local cluster: threads per GPU worker",
     "threads"),
    ("--workers", "cluster.workers", int, "N", "local cluster: CPU worker processes", ""),
    ("--threads-per-worker", "cluster.threads_per_worker", int, "N", "local cluster: threads per "
     "worker process", "threads"),
    ("--dashboard-address", "cluster.dashboard_address", str, "HOST:PORT", "local cluster: where "
     "its dashboard listens (port 0: any free port; a busy port falls back to a free one)", ""),
    ("--scheduler", "cluster.scheduler", str, "ADDRESS", "a running dask scheduler "
     "(tcp://HOST:PORT) instead of a local cluster; also $DASK_SCHEDULER_ADDRESS", ""),
    ("--tls-ca-file", "cluster.tls_ca_file", str, "PEM", "TLS: CA certificate of the cluster", ""),
    ("--tls-cert", "cluster.tls_cert", str, "PEM", "TLS: this client's certificate", ""),
    ("--tls-key", "cluster.tls_key", str, "PEM", "TLS: this client's private key", ""),
    ("--connect-timeout", "cluster.connect_timeout", float, "SECONDS", "how long to wait for the "
     "scheduler and its workers", "s"),
    ("--stall-report", "cluster.stall_report", float, "X", "report a task running X times its "
     "finished peers' median (and --stall-min-seconds)", "x"),
    ("--stall-retire", "cluster.stall_retire", float, "X", "retire the worker of a task running X "
     "times its peers' median, so its work is replayed elsewhere (0: never)", "x"),
    ("--stall-min-seconds", "cluster.stall_min_s", float, "SECONDS", "a task may always run this "
     "long before it is reported (4 x as long before its worker is retired); a task its worker "
     "is not computing is assigned again after this long", "s"),
]
_CLUSTER_FIELDS = {f for _, f, *_ in _TRAIN_OPTIONS if f.startswith("cluster.")}
_RECIPE = "the strategy's recipe: for ipm with K > 1 and adam "
_NO_DEFAULT = {"cluster.workers": "one per core", "cluster.scheduler": "none: a local cluster",
               "train.lr_scaling": "none",
               "train.warmup_epochs": _RECIPE + "1, else 0",
               "average.optimizer_state": _RECIPE + "average, else keep",
               "average.outer_lr": "1", "average.outer_warmup_epochs": "0",
               "train.beta1": "0.9", "train.beta2": "0.999", "train.adam_eps": "1e-8",
               "asynchronous.max_staleness": "no bound"}
_TOP_LEVEL = ("seed", "checkpoint_every", "anchor_every", "eval_every", "tensorboard", "csv")

TRAIN_DESCRIPTION = """\
Train a model with K replicas on a Dask cluster (a local one unless --scheduler is given).

A round is the unit of work between two synchronisations of the replicas: for ipm, H local steps
of every replica followed by their average (--mix-every); for gradient, one step; for single and
mixture, --mix-every steps. Checkpoints, evaluations and the progress bar count rounds.

Outputs in --out: metrics.jsonl (a line per round), model.npz (load it with
pipeline.load_model(OUT)), curves.png, config.json, summary.json, checkpoints/. Ctrl-C or SIGTERM
stops the run after the round in progress with a checkpoint (exit 130 or 143); --resume OUT goes
on from there."""


def _default(field: str):
    value = Config()
    for part in field.split("."):
        value = getattr(value, part)
    return value


def _help(field: str, text: str, unit: str) -> str:
    if field in _NO_DEFAULT:
        return f"{text} (default: {_NO_DEFAULT[field]})"
    value = _default(field)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == 1 and unit.endswith("s") and len(unit) > 1:
        unit = unit[:-1]  # "1 round", "1 thread"
    shown = f"{value} {unit}".strip() if value is not None else "none"
    return f"{text} (default: {shown})".replace("%", "%%")


def add_subcommands(sub) -> None:
    p = sub.add_parser("train", help="train a model on a Dask cluster (see train --help)",
                       description=TRAIN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, field, kind, metavar, text, unit in _TRAIN_OPTIONS:
        p.add_argument(flag, dest=field, type=kind, default=None, metavar=metavar,
                       help=_help(field, text, unit))
    p.add_argument("--no-recipe", dest="train.recipe", action="store_const", const=False,
                   default=None, help="ipm with K > 1 without the scale-out recipe's defaults "
                   "(lr scaling, warmup, averaged optimizer state; docs/strategies.md)")
    p.add_argument("--adaptive-outer", dest="average.adaptive_outer", action="store_const",
                   const=True, default=None,
                   help="ipm: outer lr x the replicas' AdaScale gain (1..K)")
    p.add_argument("--pin-replicas", dest="cluster.pin_replicas", action="store_const",
                   const=True, default=None,
                   help="replica k's train tasks prefer worker k mod W, as a rank stays on its "
                   "device (the default)")
    p.add_argument("--no-pin-replicas", dest="cluster.pin_replicas", action="store_const",
                   const=False, default=None,
                   help="let the scheduler place the replicas' train tasks")
    p.add_argument("--tta", dest="train.tta", action="store_const", const=True, default=None,
                   help="evaluate with test-time augmentation (flips and shifted crops)")
    p.add_argument("--download", dest="data.download", action="store_const", const=True,
                   default=None, help="download the official CIFAR archive when it is missing")
    p.add_argument("--out", metavar="OUT", default=None,
                   help="output directory (default: runs/STRATEGY-YYYYmmdd-HHMMSS)")
    p.add_argument("--resume", metavar="OUT", default=None,
                   help="go on with the run in OUT from its last checkpoint (with --epochs E: "
                        "train it on to E epochs)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--tensorboard", dest="tensorboard", action="store_const", const=True,
                   default=None, help="also write TensorBoard event files to OUT/tensorboard/")
    p.add_argument("--csv", dest="csv", action="store_const", const=True, default=None,
                   help="also write the metrics as OUT/metrics.csv")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)

    e = sub.add_parser("evaluate", help="test accuracy of a trained model",
                       description="Test loss and accuracy of a trained model, as one JSON line: "
                                   "of the run in --run OUT, or of --weights with --model.")
    e.add_argument("--run", metavar="OUT", help="a run directory written by train")
    e.add_argument("--model", metavar="NAME", help="model of --weights: small-cnn | resnet20 | "
                                                   "cifar10-2015")
    e.add_argument("--weights", metavar="NPZ", help="a model.npz written by train")
    e.add_argument("--data", metavar="SOURCE", help="test data (default with --run: the run's)")
    e.add_argument("--tta", action="store_true",
                   help="test-time augmentation (flips and shifted crops)")
    e.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                   help="image folders/lists: the size the model was trained at (default: from "
                   "config.json beside the weights, else 64)")
    e.add_argument("--val-data", default=None, metavar="SOURCE",
                   help="image folders/lists: the val split to use")
    e.add_argument("--image-root", default=None, metavar="DIR",
                   help="file lists: where relative paths start")
    e.set_defaults(func=_run_evaluate)

    d = sub.add_parser("demo", help="the main job: find or synthesize data, preview it, train ipm")
    d.add_argument("--out", metavar="OUT", default="runs/demo",
                   help="output directory (default: runs/demo)")
    d.add_argument("--epochs", metavar="E", type=float, default=3.0,
                   help="passes over the training set (default: 3 epochs)")
    d.add_argument("--download", action="store_true",
                   help="fetch CIFAR-10 (170 MB, MD5-checked) into the cache if it is missing; "
                        "without it the demo makes no network connection")
    d.set_defaults(func=_run_demo)


def config_from_args(args: argparse.Namespace) -> Config:
    given = {k: v for k, v in vars(args).items() if "." in k or k in _TOP_LEVEL}
    given = {k: v for k, v in given.items() if v is not None}
    if args.resume:
        base = saved_config(Path(args.resume))
        given["out"] = args.resume
    else:
        base = Config()
        if args.out is not None:
            given["out"] = args.out
        if given.get("train.strategy") == "single" and "train.replicas" not in given:
            given["train.replicas"] = 1
    given["progress"] = not args.no_progress
    return base.replace(**given)


def saved_config(run: Path) -> Config:
    """The config a run directory was written with, read as any input is (``rundir.read_config``:
    a regular file, capped, every field checked). Where and how it runs (the cluster section:
    scheduler, dashboard bind, TLS) is never taken from the directory; the command line or the
    defaults give it."""
    from pipeline.outputs import fs as rundir
    path = run / "config.json"
    if not path.exists() and not path.is_symlink():
        raise UsageError(f"cannot resume {run}: no config.json there")
    try:
        return rundir.read_config(run, cluster=False)
    except UsageError as exc:
        text = str(exc).replace(f"{path} is unreadable", "config.json is unreadable")
        raise UsageError(f"cannot resume {run}: {text.replace(str(path), 'config.json')}") \
            from None


def _run_train(args) -> int:
    from pipeline.outputs import dashboard
    from pipeline.core.interrupt import graceful_stop
    from pipeline.training.loop import train
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise UsageError("--resume OUT continues OUT; do not also give a different --out")
    config = config_from_args(args)
    if config.out is None:
        config.validate()  # a bad option is the one line, not after an output path
        config = config.replace(out=default_out(config.train.strategy))
        print(f"output: {config.out} (--out)", file=sys.stderr, flush=True)
    page = dashboard.DashboardEvents(run=Path(config.out).name)  # the /training page of this run
    with graceful_stop() as stop, dashboard.dashboard_log(Path(config.out) / "dashboard.log"):
        result = train(config, resume=bool(args.resume), overwrite=args.overwrite, stop=stop,
                       hooks=[page])
    if result.status == "complete":
        return 0
    print(summary_line(result))
    return 0


def default_out(strategy: str, root: str = "runs") -> str:
    """``runs/<strategy>-<YYYYmmdd-HHMMSS>``, with a suffix if that exists already."""
    import time
    base = Path(root) / f"{strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return str(out)


def summary_line(result) -> str:
    last = result.history[-1] if result.history else {}
    parts = [f"done: {last.get('round', -1) + 1} rounds in {last.get('seconds', 0):.1f} s",
             f"train_acc {last.get('train_acc', float('nan')):.3f}"]
    if "test_acc" in last:
        parts.append(f"test_acc {last['test_acc']:.3f}")
    if result.out:
        out = Path(result.out)
        parts.append(f"-> {out / 'metrics.jsonl'}, {out / 'model.npz'}, {out / 'curves.png'}")
    return ", ".join(parts)


def _run_evaluate(args) -> int:
    from pipeline.training.evaluate import evaluate_weights, load_model, run_config
    from pipeline.outputs.fs import dumps
    if args.run:
        if args.model or args.weights:
            raise UsageError("evaluate: give either --run OUT or --model with --weights")
        config = run_config(args.run)
        load_model(args.run)  # one line for a run without model.npz, before any data is read
        args.model, args.weights = config.model.name, str(Path(args.run) / "model.npz")
        args.data = args.data or config.data.source
    missing = [f for f, v in (("--model", args.model), ("--weights", args.weights),
                              ("--data", args.data)) if not v]
    if missing:
        raise UsageError(f"evaluate needs --run OUT, or --model, --weights and --data "
                         f"(missing {', '.join(missing)})")
    data = _evaluate_data_config(args)
    print(dumps(evaluate_weights(args.model, args.weights, args.data, tta=args.tta, data=data)))
    return 0


def _evaluate_data_config(args):
    """The data section for evaluate: the training run's (config.json beside the weights) for
    what it says about the images, overridden by the options given."""
    import dataclasses
    from pipeline.core.config import DataConfig
    from pipeline.outputs.fs import read_json
    saved = Path(args.weights).parent / "config.json"
    base = DataConfig()
    try:  # read like any input: a regular file, capped, of the right types
        section = read_json(saved).get("data", {})
        keep = {k: section[k] for k in ("image_size", "val_fraction", "split_seed", "max_pixels",
                                         "image_root", "val_source") if k in section}
        base = dataclasses.replace(base, **keep)
        base.validate()
    except (UsageError, ValueError, TypeError, AttributeError, RecursionError):
        base = DataConfig()  # no readable config.json: the defaults
    given = {"image_size": args.image_size, "val_source": args.val_data,
             "image_root": args.image_root}
    return dataclasses.replace(base, source=args.data,
                               **{k: v for k, v in given.items() if v is not None})


def _demo_data(log, download: bool) -> str:
    """Real CIFAR-10 from the cache, fetched first with ``download``; else the synthetic set.
    Without ``download`` nothing touches the network (as torchvision's ``download=False``)."""
    from pipeline.data import datasets as data
    from pipeline.core.config import DataConfig
    from pipeline.core.errors import DataError
    try:
        return data.resolve_source("cifar10", DataConfig())
    except DataError:
        pass
    if download:
        try:
            return data.fetch("cifar10")
        except DataError as exc:  # a failed download is not fatal for the demo
            log(f"could not download CIFAR-10: {exc}")
    else:
        log("notice: CIFAR-10 is not in the cache; the demo trains on the synthetic set "
            "(5,000 train / 1,000 test images). `python -m pipeline demo --download` fetches "
            "CIFAR-10 (170 MB) first")
        return "synthetic"
    log("notice: the demo trains on the synthetic set (5,000 train / 1,000 test images)")
    return "synthetic"


def _run_demo(args) -> int:
    from pipeline.data.datasets import inspect_dataset, load_dataset
    from pipeline.outputs.preview import augmentation_preview, image_grid
    from pipeline.training.loop import train
    import augment

    def log(message):
        print(message, file=sys.stderr, flush=True)

    from pipeline.outputs import fs as rundir
    out = Path(args.out)
    rundir.check(out, resume=False, overwrite=True)  # only ever replaces a run of ours
    source = _demo_data(log, args.download)
    summary = inspect_dataset(source)
    print(rundir.dumps(summary))
    ds = load_dataset(source)
    images = ds.train_images[:30].compute()
    labels = ds.train_labels[:30].compute()
    rundir.claim(out)
    image_grid(images, labels, ds.label_names).savefig(out / "images.png")
    augmentation_preview(images[:8], augment.get_policy("cifar"), seed=0).savefig(
        out / "augment.png")
    print(f"images: {out / 'images.png'}, augmentation preview: {out / 'augment.png'}")
    config = Config().replace(**{
        "data.source": source, "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 4, "train.batch_size": 16, "train.lr": 0.02, "train.epochs": args.epochs,
        "train.warmup_epochs": 0.25,  # without it small-cnn sits at chance for the first epoch
        "average.mix_every": "5", "augment.policy": "cifar", "cluster.workers": 2,
        "cluster.threads_per_worker": 1, "out": str(out), "seed": 0})
    result = train(config, overwrite=True, log=log)
    print(summary_line(result))
    return 0
