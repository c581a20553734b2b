"""The training state as a value on the host: what a checkpoint holds, what a resume or a replay
starts from, and what a strategy's ``gather`` returns (plain NumPy dicts keyed by parameter path).

Here, below both its users: the strategies and the loop (``pipeline.training``) make and read it;
checkpoints and resumes (``pipeline.outputs``) write and read it back.
"""
from __future__ import annotations

from typing import NamedTuple


class HostState(NamedTuple):
    """The whole training state after round ``round`` (-1: before the first round), on the host."""
    round: int
    params: list  # per replica: dict[str, np.ndarray]
    opts: list  # per replica: dict[str, np.ndarray] or None
    outer: dict | None  # outer optimizer momentum buffer, or None
