"""CLI subcommands that run training: train, evaluate, demo."""
from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from pipeline.config import Config
from pipeline.errors import UsageError

# --flag -> dotted config field; argparse leaves unset options None so a resume can tell them apart.
_TRAIN_OPTIONS = [
    ("--data", "data.source", str, "synthetic, synthetic:N:M, a CIFAR directory/tarball, an "
     "image folder (root/<class>/<image>, optional train/ and val/) or a file list (path label)"),
    ("--image-size", "data.image_size", int, "image folders/lists: side of the square images "
     "(pixels, default 64)"),
    ("--val-fraction", "data.val_fraction", float, "image folders/lists without val/: share of "
     "each class held out (default 0.1)"),
    ("--val-data", "data.val_source", str, "image folders/lists: a folder or file list as val split"),
    ("--image-root", "data.image_root", str, "file lists: where relative paths start "
     "(default: the list's directory)"),
    ("--cache", "data.cache", str, "keep decoded images on the workers: auto | on | off"),
    ("--model", "model.name", str, "cifar10-2015 | resnet20 | small-cnn"),
    ("--strategy", "train.strategy", str, "single | gradient | mixture | ipm"),
    ("--replicas", "train.replicas", int, "K model replicas (independent of workers)"),
    ("--mix-every", "average.mix_every", str, "ipm period H: steps (10) or epochs (1ep)"),
    ("--epochs", "train.epochs", float, "passes over the training set"),
    ("--batch-size", "train.batch_size", int, "images per replica per step"),
    ("--optimizer", "train.optimizer", str, "sgd | momentum | adam"),
    ("--lr", "train.lr", float, "replica learning rate (Adam: alpha)"),
    ("--momentum", "train.momentum", float, "momentum of the momentum optimizer"),
    ("--weight-decay", "train.weight_decay", float, "L2 coefficient"),
    ("--lr-scaling", "train.lr_scaling", str, "none | linear | sqrt in K (seed 004)"),
    ("--warmup-epochs", "train.warmup_epochs", float, "linear learning-rate warmup"),
    ("--outer-lr", "average.outer_lr", float, "outer optimizer learning rate (1 = plain mean)"),
    ("--outer-momentum", "average.outer_momentum", float, "outer Nesterov momentum (DiLoCo)"),
    ("--optimizer-state", "average.optimizer_state", str, "keep | reset | average at a mix"),
    ("--fan-in", "average.fan_in", int, "children per average- task in the reduction tree"),
    ("--augment", "augment.policy", str, "augmentation policy: none | flip | cifar | cifar-cutout "
     "| resized-crop (image folders)"),
    ("--prefetch", "augment.prefetch", int, "rounds of augmentation computed ahead"),
    ("--seed", "seed", int, "run seed"),
    ("--checkpoint-every", "checkpoint_every", int, "checkpoint every N rounds (0: end only)"),
    ("--eval-every", "eval_every", int, "also evaluate every N rounds"),
    ("--device", "train.device", str, "cpu | gpu | auto"),
    ("--gpu-resource", "train.gpu_resource", str, "worker resource GPU tasks ask for"),
    ("--gpu-workers-per-device", "cluster.gpu_workers_per_device", int,
     "LocalCluster GPU worker processes per device"),
    ("--gpu-threads", "cluster.gpu_threads", int, "LocalCluster threads per GPU worker"),
    ("--workers", "cluster.workers", int, "LocalCluster workers"),
    ("--threads-per-worker", "cluster.threads_per_worker", int, "LocalCluster threads per worker"),
    ("--scheduler", "cluster.scheduler", str, "address of a running dask scheduler"),
    ("--tls-ca-file", "cluster.tls_ca_file", str, "TLS CA certificate"),
    ("--tls-cert", "cluster.tls_cert", str, "TLS client certificate"),
    ("--tls-key", "cluster.tls_key", str, "TLS client key"),
    ("--connect-timeout", "cluster.connect_timeout", float, "seconds to wait for the scheduler"),
]
_CLUSTER_FIELDS = {f for _, f, _, _ in _TRAIN_OPTIONS if f.startswith("cluster.")}


def add_subcommands(sub) -> None:
    p = sub.add_parser("train", help="train a model on the cluster (see --help for every option)")
    for flag, field, kind, text in _TRAIN_OPTIONS:
        p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    p.add_argument("--tta", dest="train.tta", action="store_const", const=True, default=None,
                   help="evaluate with test-time augmentation")
    p.add_argument("--download", dest="data.download", action="store_const", const=True,
                   default=None, help="download the official CIFAR archive when missing")
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--resume", metavar="OUT", default=None, help="continue the run in OUT")
    p.add_argument("--overwrite", action="store_true", help="replace a finished run in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train)

    e = sub.add_parser("evaluate", help="test accuracy of saved weights (model.npz)")
    e.add_argument("--model", required=True)
    e.add_argument("--weights", required=True, help="a model.npz written by train")
    e.add_argument("--data", required=True)
    e.add_argument("--tta", action="store_true")
    e.add_argument("--image-size", type=int, default=None,
                   help="image folders/lists: the size the model was trained at (default: from "
                   "config.json beside the weights, else 64)")
    e.add_argument("--val-data", default=None, help="image folders/lists: the val split to use")
    e.add_argument("--image-root", default=None, help="file lists: where relative paths start")
    e.set_defaults(func=_run_evaluate)

    d = sub.add_parser("demo", help="the main job: synthesize or find data, preview, train ipm")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--epochs", type=float, default=3.0)
    d.set_defaults(func=_run_demo)


def config_from_args(args: argparse.Namespace) -> Config:
    given = {k: v for k, v in vars(args).items()
             if "." in k or k in ("seed", "checkpoint_every", "eval_every")}
    given = {k: v for k, v in given.items() if v is not None}
    if args.resume:
        saved = Path(args.resume) / "config.json"
        try:
            base = Config.from_dict(json.loads(saved.read_text()))
        except OSError:
            raise UsageError(f"cannot resume {args.resume}: no config.json there") from None
        except (ValueError, TypeError) as exc:
            raise UsageError(f"cannot resume {args.resume}: config.json is unreadable ({exc})") \
                from None
        given["out"] = args.resume
    else:
        base = Config()
        if args.out is not None:
            given["out"] = args.out
        if given.get("train.strategy") == "single" and "train.replicas" not in given:
            given["train.replicas"] = 1
    given["progress"] = not args.no_progress
    return base.replace(**given)


def _run_train(args) -> int:
    from pipeline.training import train
    if args.resume and args.out and Path(args.out) != Path(args.resume):
        raise UsageError("--resume OUT continues OUT; do not also give a different --out")
    config = config_from_args(args)
    result = train(config, resume=bool(args.resume), overwrite=args.overwrite)
    print(summary_line(result))
    return 0


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
    from pipeline.evaluation import evaluate_weights
    data = _evaluate_data_config(args)
    print(json.dumps(evaluate_weights(args.model, args.weights, args.data, tta=args.tta,
                                      data=data)))
    return 0


def _evaluate_data_config(args):
    """The data section for evaluate: the training run's (config.json beside the weights) for
    what it says about the images, overridden by the options given."""
    import dataclasses
    from pipeline.config import DataConfig
    saved = Path(args.weights).parent / "config.json"
    base = DataConfig()
    try:
        section = json.loads(saved.read_text()).get("data", {})
        keep = {k: section[k] for k in ("image_size", "val_fraction", "split_seed", "max_pixels",
                                         "image_root", "val_source") if k in section}
        base = dataclasses.replace(base, **keep)
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # no readable config.json: the defaults
    given = {"image_size": args.image_size, "val_source": args.val_data,
             "image_root": args.image_root}
    return dataclasses.replace(base, source=args.data,
                               **{k: v for k, v in given.items() if v is not None})


def _network_allows(host: str = "www.cs.toronto.edu", port: int = 443) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def _demo_data(log) -> str:
    """Real CIFAR-10 from the cache, downloaded if the network allows; else the synthetic set."""
    from pipeline import data
    from pipeline.config import DataConfig
    from pipeline.errors import DataError
    try:
        return data.resolve_source("cifar10", DataConfig())
    except DataError:
        pass
    if _network_allows():
        try:
            return data.fetch("cifar10")
        except DataError as exc:  # a failed download is not fatal for the demo
            log(f"could not download CIFAR-10: {exc}")
    log("notice: CIFAR-10 is not in the cache and cannot be downloaded here; "
        "the demo trains on the synthetic set (5,000 train / 1,000 test images)")
    return "synthetic"


def _run_demo(args) -> int:
    from pipeline.data import inspect_dataset, load_dataset
    from pipeline.preview import augmentation_preview, image_grid
    from pipeline.training import train
    import augment

    def log(message):
        print(message, file=sys.stderr, flush=True)

    out = Path(args.out)
    source = _demo_data(log)
    summary = inspect_dataset(source)
    print(json.dumps(summary))
    ds = load_dataset(source)
    images = ds.train_images[:30].compute()
    labels = ds.train_labels[:30].compute()
    out.mkdir(parents=True, exist_ok=True)
    image_grid(images, labels, ds.label_names).savefig(out / "images.png")
    augmentation_preview(images[:8], augment.get_policy("cifar"), seed=0).savefig(
        out / "augment.png")
    print(f"images: {out / 'images.png'}, augmentation preview: {out / 'augment.png'}")
    config = Config().replace(**{
        "data.source": source, "model.name": "small-cnn", "train.strategy": "ipm",
        "train.replicas": 4, "train.batch_size": 16, "train.lr": 0.02, "train.epochs": args.epochs,
        "average.mix_every": "5", "augment.policy": "cifar", "cluster.workers": 2,
        "cluster.threads_per_worker": 1, "out": str(out), "seed": 0})
    result = train(config, overwrite=True, log=log)
    print(summary_line(result))
    return 0
