"""The command line: argument parsing and the mapping of user errors to one line and exit
status 2."""
from __future__ import annotations

import argparse
import sys

from pipeline.cli import options
from pipeline.core.config_data import DATASETS
from pipeline.core.errors import DivergenceError, Interrupted, UsageError
from pipeline.core.text import printable


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage; we print one line
        raise UsageError(f"{self.prog}: {message}")

    def format_help(self):
        for action in self._actions:  # help that reads registries: pipeline.cli.options
            if callable(action.help):
                action.help = action.help()
        return super().format_help()


def _add_synth(sub):
    p = sub.add_parser("synth",
                       help="write a synthetic dataset in the official CIFAR-10 python format")
    p.add_argument("--out", required=True, help="directory to write cifar-10-batches-py/ into")
    p.add_argument("--train", type=int, default=5000, help="training images (default 5000)")
    p.add_argument("--test", type=int, default=1000, help="test images (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tar", action="store_true", help="also pack cifar-10-python.tar.gz")
    p.set_defaults(func=_run_synth)


def _run_synth(args):
    from pipeline.data.cifar import write_synthetic
    path = write_synthetic(args.out, n_train=args.train, n_test=args.test, seed=args.seed,
                           tar=args.tar)
    print(path)


_INSPECT_DATA = options.pick("data.source", "data.download", "data.image_size",
                             "data.val_source", "data.val_fraction", "data.image_root")


def _add_inspect(sub):
    p = sub.add_parser("inspect",
                       help="print counts, shape and class histogram of a dataset as JSON")
    options.add_options(p, _INSPECT_DATA, required=("data.source",))
    p.set_defaults(func=_run_inspect)


def _run_inspect(args):
    import dataclasses
    from pipeline.core.config_data import DataConfig
    from pipeline.data.datasets import inspect_dataset
    cfg = dataclasses.replace(DataConfig(), **options.section_given(args, _INSPECT_DATA, "data"))
    from pipeline.outputs.fs import dumps
    print(dumps(inspect_dataset(cfg.source, download=cfg.download, cfg=cfg)))


def _add_fetch(sub):
    p = sub.add_parser("fetch",
                       help="download an official CIFAR archive into the cache (MD5-checked)")
    p.add_argument("--dataset", default=DATASETS[0], choices=DATASETS)
    p.add_argument("--format", default="python", choices=["python", "binary"])
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_run_fetch)


def _run_fetch(args):
    from pipeline.data.datasets import fetch
    print(fetch(args.dataset, fmt=args.format, cache_dir=args.cache_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pipeline",
                     description="Data-parallel Chainer training on Dask task graphs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in (_add_synth, _add_inspect, _add_fetch):
        add(sub)
    from pipeline.cli import commands  # train, evaluate, demo live with the training code
    commands.add_subcommands(sub)
    from pipeline.cli import export  # export, and predict --onnx's reading
    export.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        result = args.func(args)
        return int(result or 0)
    except UsageError as exc:  # includes DataError, ClusterError, ResumeError
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # config validation names the field
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 2
    except DivergenceError as exc:  # not bad input: the run itself blew up
        print(f"error: {printable(exc)}", file=sys.stderr)
        return 3
    except Interrupted as exc:  # Ctrl-C or SIGTERM: stopped at a round boundary, checkpointed
        print(printable(exc), file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt as exc:  # a second signal, or one outside a run: stopped at once
        print(getattr(exc, "line", None) or "error: interrupted; a run stops cleanly at the next "
              "round boundary after one Ctrl-C (or SIGTERM), a second one stops it at once",
              file=sys.stderr)
        return getattr(exc, "exit_status", 130)
    except MemoryError:  # never a traceback: what was asked does not fit in this machine
        print("error: out of memory (the data, model or batch does not fit; nothing was saved "
              "since the last checkpoint)", file=sys.stderr)
        return 1
