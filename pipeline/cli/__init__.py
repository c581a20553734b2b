"""The command line: ``python -m pipeline`` and the ``dask-chainer`` console script. The parser
and the data commands (synth, inspect, fetch) are in ``parser``; train, evaluate and demo in
``commands``.
"""
from pipeline.cli.parser import build_parser, main

__all__ = ("build_parser", "main")
