"""Test helper: a run stopped after a round and resumed, next to the same run uninterrupted."""
from __future__ import annotations

import pytest

from pipeline.training.loop import train


class Stop(Exception):
    """Raised from ``on_round``: the run stops as a killed driver would, checkpoints kept."""


def whole_and_resumed(cfg, tmp_path, client, stop_after: int = 4):
    """Train ``cfg`` into ``tmp_path/whole``; train it into ``tmp_path/cut``, stopped once round
    ``stop_after`` is reported, and resume that. Returns the two results (whole, resumed)."""
    whole = train(cfg.replace(out=str(tmp_path / "whole")), client=client)

    def stop(line):
        if line["round"] == stop_after:
            raise Stop

    with pytest.raises(Stop):
        train(cfg.replace(out=str(tmp_path / "cut")), client=client, on_round=stop)
    resumed = train(cfg.replace(out=str(tmp_path / "cut")), client=client, resume=True)
    return whole, resumed
