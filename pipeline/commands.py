"""CLI subcommands that run training: train, evaluate, demo."""
from __future__ import annotations


def add_subcommands(sub) -> None:
    pass
