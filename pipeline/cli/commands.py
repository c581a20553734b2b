"""CLI subcommands that run training: train, evaluate, predict, demo."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli import options
from pipeline.core.config import Config
from pipeline.core.errors import Interrupted, UsageError, one_line
from pipeline.core.interrupt import ForcedStop
from pipeline.core.text import printable

# The train options: every config field declared with a flag (pipeline.core.fields.opt).
TRAIN_OPTIONS = options.options()
_EVALUATE_DATA = options.pick("data.image_size", "data.val_source", "data.image_root")

# What people set most: train --help opens with these (the rest follow by config section).
MOST_USED = ("data.source", "model.name", "train.strategy", "train.replicas", "train.epochs",
             "train.batch_size", "train.lr", "train.device")
TRAIN_USAGE = ("python -m pipeline train [--data SOURCE] [--model NAME] [--strategy NAME] "
               "[--replicas K]\n       [--epochs E] [--batch-size B] [--lr LR] [--out OUT | "
               "--resume OUT] [options]")

TRAIN_DESCRIPTION = """\
Train a model with K replicas on a Dask cluster (a local one unless --scheduler is given).

A round is the unit of work between two synchronisations of the replicas: for ipm, H local steps
of every replica followed by their average (--mix-every); for gradient, one step; for single and
mixture, --mix-every steps. Checkpoints, evaluations and the progress bar count rounds.

Outputs in --out: metrics.jsonl (a line per round), model.npz (load it with
pipeline.load_model(OUT)), curves.png, config.json, summary.json, checkpoints/. Ctrl-C or SIGTERM
stops the run after the round in progress with a checkpoint (exit 130 or 143); --resume OUT goes
on from there."""


def add_subcommands(sub) -> None:
    p = sub.add_parser("train", help="train a model on a Dask cluster (see train --help)",
                       description=TRAIN_DESCRIPTION, usage=TRAIN_USAGE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="OUT", default=None,
                   help="output directory (default: runs/STRATEGY-YYYYmmdd-HHMMSS)")
    p.add_argument("--resume", metavar="OUT", default=None,
                   help="go on with the run in OUT from its last checkpoint (with --epochs E: "
                        "train it on to E epochs)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="start from this config (the config.json format: any run's config.json "
                        "will do; its out is not taken: --out says where, nor its cluster "
                        "section: see --config-cluster); the options given win over it")
    p.add_argument("--config-cluster", action="store_true",
                   help="also take the cluster section of --config FILE (its scheduler address, "
                        "dashboard bind, TLS files, worker counts): only for a file you trust "
                        "to say where your driver connects")
    p.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   dest="set_fields",
                   help="set any config field, also those without an option (data.split_seed=1, "
                        "data.max_pixels=1000000, data.label_kind=coarse); repeatable; wins over "
                        "--config and the options")
    options.add_options(p, TRAIN_OPTIONS, grouped=True, first=MOST_USED)
    p.set_defaults(func=_run_train)

    e = sub.add_parser("evaluate", help="test accuracy of a trained model",
                       description="Test loss and accuracy of a trained model, as one JSON line: "
                                   "of the run in --run OUT, or of --weights with --model.")
    e.add_argument("--run", metavar="OUT", help="a run directory written by train")
    model = e.add_argument("--model", metavar="NAME")
    model.help = options.defer(lambda: "model of --weights: " + " | ".join(
        options.choices("model.name")) + ", or pkg.module:factory (your own; with --run, the "
        "run's own model named again)")
    e.add_argument("--weights", metavar="NPZ", help="a model.npz written by train")
    e.add_argument("--data", metavar="SOURCE", help="test data (default with --run: the run's)")
    options.add_options(e, options.pick("train.tta"))
    options.add_options(e, _EVALUATE_DATA, frame="from config.json beside the weights, else {}")
    e.set_defaults(func=_run_evaluate)

    r = sub.add_parser("predict", help="classify images with a trained run: top-k classes",
                       description="Top-k classes (names and probabilities) of each image under "
                                   "the model of --run OUT; images are read as the run's "
                                   "evaluation read its split (its image size and centre crop).")
    source = r.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="OUT", help="a run directory written by train")
    source.add_argument("--onnx", metavar="FILE", help="a file written by export, run by "
                        "onnxruntime without Chainer (pipeline/cli/export.py)")
    r.add_argument("images", metavar="IMAGE", nargs="+",
                   help="image files, or folders of them (sorted, nested folders too)")
    r.add_argument("--model", metavar="pkg.module:factory",
                   help="a run of your own model: name it again (a run directory never imports "
                        "code)")
    r.add_argument("--top", metavar="K", type=int, default=3,
                   help="classes shown per image (default: 3)")
    r.add_argument("--format", choices=("table", "json"), default="table",
                   help="table: one line per image; json: one JSON object per image "
                        "(default: table)")
    options.add_options(r, options.pick("train.tta"))
    r.set_defaults(func=_run_predict)

    d = sub.add_parser("demo", help="the main job: find or synthesize data, preview it, train ipm")
    d.add_argument("--out", metavar="OUT", default="runs/demo",
                   help="output directory (default: runs/demo)")
    d.add_argument("--epochs", metavar="E", type=float, default=3.0,
                   help="passes over the training set (default: 3 epochs)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (without it, a finished or "
                        "interrupted run there is refused, as train refuses it)")
    d.add_argument("--download", action="store_true",
                   help="fetch CIFAR-10 (170 MB, MD5-checked) into the cache if it is missing; "
                        "without it the demo makes no network connection")
    d.set_defaults(func=_run_demo)


def config_from_args(args: argparse.Namespace) -> Config:
    given = options.given(args, TRAIN_OPTIONS)
    for text in getattr(args, "set_fields", None) or ():
        dest, value = options.parse_set(text)
        given[dest] = value
    config_file = getattr(args, "config", None)
    cluster = bool(getattr(args, "config_cluster", False))
    if cluster and not config_file:  # --resume never takes a cluster section either
        raise UsageError("--config-cluster takes the cluster section of --config FILE; "
                         "give --config")
    if args.resume:
        if config_file:
            raise UsageError("--resume OUT goes on with OUT's config.json; do not also give "
                             "--config")
        base = saved_config(Path(args.resume))
        from pipeline.backends import user as user_code  # its model.args: its own model's only
        user_code.paired(base.model.name, given.get("model.name", base.model.name))
        given["out"] = args.resume
    else:
        base = config_file_config(Path(config_file), cluster) if config_file else Config()
        if args.out is not None:
            given["out"] = args.out
        if given.get("train.strategy") == "single" and "train.replicas" not in given:
            given["train.replicas"] = 1
    given.setdefault("progress", True)  # the terminal's choice, not the saved run's
    return base.replace(**given)


def config_file_config(path: Path, cluster: bool = False) -> Config:
    """The config of ``--config FILE`` (config.json format, read as any input is: a regular
    file, capped, every field checked); where the outputs go (``out``) is never taken from it,
    and where it runs (the cluster section: scheduler, dashboard bind, TLS files) only with
    ``cluster`` (``--config-cluster``), as ``--resume`` never takes it from a run directory; a
    section left out that differs from the defaults is one line on stderr."""
    from pipeline.outputs.fs import read_json
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file")
    saved = read_json(path, UsageError)
    if isinstance(saved, dict):
        saved = {k: v for k, v in saved.items() if k not in ("out", "progress")}
        if not cluster and "cluster" in saved:
            _dropped_cluster_line(path, saved.pop("cluster"))
    try:
        return Config.from_dict(saved)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--config {path}: {one_line(exc, kind=False, limit=160)}") from None


def _dropped_cluster_line(path: Path, section) -> None:
    """Say so when the cluster section ``--config FILE`` had and we dropped is not the defaults'."""
    import dataclasses
    from pipeline.core.config_cluster import ClusterConfig
    default = dataclasses.asdict(ClusterConfig())
    if not isinstance(section, dict):
        differ = ["cluster"]
    else:
        differ = [str(k) for k, v in section.items() if k not in default or default[k] != v]
    if differ:
        print(printable(f"--config {path}: its cluster section ({', '.join(differ[:6])}"
                        f"{', ...' if len(differ) > 6 else ''}) is not taken: the options or "
                        "the defaults say where this run runs (--config-cluster takes it)"),
              file=sys.stderr, flush=True)


def saved_config(run: Path) -> Config:
    """The config a run directory was written with, read as any input is (``fs.read_config``:
    a regular file, capped, every field checked). Where and how it runs (the cluster section:
    scheduler, dashboard bind, TLS) is never taken from the directory; the command line or the
    defaults give it."""
    from pipeline.outputs import fs
    path = run / "config.json"
    if not path.exists() and not path.is_symlink():
        raise UsageError(f"cannot resume {run}: no config.json there")
    try:
        return fs.read_config(run, cluster=False)
    except UsageError as exc:
        text = str(exc).replace(f"{path} is unreadable", "config.json is unreadable")
        raise UsageError(f"cannot resume {run}: {text.replace(str(path), 'config.json')}") \
            from None


def _run_train(args) -> int:
    from pipeline.backends import user as user_code
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
    named = options.given(args, TRAIN_OPTIONS).get("model.name")
    model = named if named and user_code.is_import_path(named) else None  # the user named it
    opt = options.given(args, TRAIN_OPTIONS).get("train.optimizer")
    opt = opt if opt and user_code.is_import_path(opt) else None  # the user's factory, named
    try:
        with graceful_stop() as stop, dashboard.dashboard_log(Path(config.out) / "dashboard.log"):
            stop.in_setup = True  # a signal stops at once until the rounds start
            result = train(config, model=model, optimizer=opt, resume=bool(args.resume),
                           overwrite=args.overwrite, stop=stop, hooks=[page])
    except ForcedStop as exc:  # a second Ctrl-C: stopped mid-round, still one line and a hint
        if exc.in_setup:
            raise
        raise Interrupted(forced_stop_line(exc, Path(config.out)), exc.exit_status) from None
    if result.status == "complete":
        return 0
    print(summary_line(result))
    return 0


def forced_stop_line(exc, out: Path) -> str:
    """What a second signal prints: stopped at once, and where the run can go on from."""
    from pipeline.outputs import fs
    from pipeline.training.recovery import resume_hint
    dirs = fs.checkpoint_dirs(out / "checkpoints") if fs.is_ours(out) else []
    hint = resume_hint(out, dirs[-1][0] if dirs else -1, bool(dirs))
    return f"stopped at once ({exc}, a second signal){hint}"


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
    if "test_acc" in last:  # image sources evaluate on their val split, and say so
        from pipeline.training.extensions import eval_split
        parts.append(f"{eval_split(result.config.data.dataset)}_acc {last['test_acc']:.3f}")
    if result.out:
        out = Path(result.out)
        parts.append(f"-> {out / 'metrics.jsonl'}, {out / 'model.npz'}, {out / 'curves.png'}")
    return ", ".join(parts)


def _run_evaluate(args) -> int:
    from pipeline.training.evaluate import evaluate_weights, load_model, run_config
    from pipeline.outputs.fs import dumps
    model_args, backend = "{}", "chainer"
    if args.run:
        if args.weights:
            raise UsageError("evaluate: give either --run OUT (with --model for a run of your "
                             "own model) or --model with --weights")
        config = run_config(args.run)
        # one line for a run without model.npz, or of your own model not named by --model
        load_model(args.run, args.model)
        if not args.data and not _refindable(config):
            print(dumps(_evaluate_kept(args, config)))
            return 0
        args.model, args.weights = config.model.name, str(Path(args.run) / "model.npz")
        args.data = args.data or config.data.source
        model_args, backend = config.model.args, config.model.backend
    missing = [f for f, v in (("--model", args.model), ("--weights", args.weights),
                              ("--data", args.data)) if not v]
    if missing:
        raise UsageError(f"evaluate needs --run OUT, or --model, --weights and --data "
                         f"(missing {', '.join(missing)})")
    data = _evaluate_data_config(args)
    tta = bool(getattr(args, "train.tta"))
    print(dumps(evaluate_weights(args.model, args.weights, args.data, tta=tta, data=data,
                                 model_args=model_args, backend=backend)))
    return 0


def _refindable(config) -> bool:
    from pipeline.data.datasets import facts
    return facts(config.data.dataset).refindable


def _evaluate_kept(args, config) -> dict:
    """evaluate --run of a run whose data no source finds again (arrays from Python): on the
    evaluation split it kept (pipeline.data.kept), else one line asking for --data."""
    from pipeline.data.kept import EVAL_FILE, MAX_KEPT_BYTES
    from pipeline.training.evaluate import _n_classes, evaluate_kept, model_of
    run = Path(args.run)
    if not (run / EVAL_FILE).is_file():
        raise UsageError(f"{run} trained on arrays given from Python and kept no evaluation split "
                         f"(no {EVAL_FILE}: it was over {MAX_KEPT_BYTES >> 20} MiB); give the test data with "
                         "--data")
    n_classes = _n_classes(run, config)
    model = model_of(config, args.model, n_classes)
    return evaluate_kept(model, str(run / "model.npz"), run, n_classes,
                         tta=bool(getattr(args, "train.tta")), backend=config.model.backend)


def _run_predict(args) -> int:
    from pipeline.outputs.fs import dumps
    from pipeline.training.predict import predict
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    if args.onnx:
        from pipeline.cli.export import predict_onnx
        result = predict_onnx(args)
    else:
        result = predict(args.run, args.images, tta=bool(getattr(args, "train.tta")),
                         model=args.model)
    for image, top in zip(result.images, result.top(args.top)):
        if args.format == "json":
            print(dumps({"image": image, "top": [{"class": n, "probability": round(p, 4)}
                                                 for n, p in top]}))
        else:
            print(f"{printable(image)}  " + "  ".join(f"{printable(n)} {p:.3f}" for n, p in top))
    return 0


def _evaluate_data_config(args):
    """The data section for evaluate: the training run's (config.json beside the weights) for
    what it says about the images, overridden by the options given."""
    import dataclasses
    from pipeline.core.config_data import DataConfig
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
    return dataclasses.replace(base, source=args.data,
                               **options.section_given(args, _EVALUATE_DATA, "data"))


def _demo_data(log, download: bool) -> str:
    """Real CIFAR-10 from the cache, fetched first with ``download``; else the synthetic set.
    Without ``download`` nothing touches the network (as torchvision's ``download=False``)."""
    from pipeline.data import datasets as data
    from pipeline.core.config_data import DataConfig
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

    def log(message):  # the data's notes name its files and classes
        print(printable(message), file=sys.stderr, flush=True)

    from pipeline.outputs import fs
    from pipeline.outputs import run_dir
    out = Path(args.out)
    try:  # as train: a run there is replaced only with --overwrite, and only a run of ours
        run_dir.prepare(str(out), resume=False, overwrite=args.overwrite)
    except UsageError as exc:
        raise UsageError(str(exc).replace("pick another --out", "pick another --out, or "
                                          "replace it with --overwrite")) from None
    source = _demo_data(log, args.download)
    summary = inspect_dataset(source)
    print(fs.dumps(summary))
    ds = load_dataset(source)
    images = ds.train_images[:30].compute()
    labels = ds.train_labels[:30].compute()
    fs.claim(out)
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
    result = train(config, overwrite=args.overwrite, log=log)
    print(summary_line(result))
    return 0
