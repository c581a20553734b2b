"""What the outputs tests share: a run's metrics lines (fixed, and as a Hypothesis strategy)."""
from __future__ import annotations

from hypothesis import strategies as st


def metrics_line(r: int, tested: bool = False) -> dict:
    line = {"round": r, "epoch": r // 4, "epoch_float": (r + 1) / 4, "step": 4 * (r + 1),
            "train_loss": 2.3 - 0.1 * r, "train_acc": 0.1 + 0.02 * r, "lr": 0.01, "images": 64,
            "seconds": 1.5 * (r + 1), "bytes_averaged": 155728,
            "stage_seconds": {"train": 1.0, "waiting": 0.1}}
    if tested:
        line.update(test_loss=2.2 - 0.1 * r, test_acc=0.15 + 0.02 * r)
    return line


HISTORY = [metrics_line(r, tested=r % 2 == 1) for r in range(4)]


line_st = st.fixed_dictionaries(
    {"round": st.integers(0, 10**6), "epoch_float": st.floats(0, 1e3),
     "train_loss": st.floats(0, 1e3), "train_acc": st.floats(0, 1)},
    optional={"test_loss": st.floats(0, 1e3), "seconds": st.floats(0, 1e5),
              "stage_seconds": st.dictionaries(st.sampled_from(["train", "average"]),
                                               st.floats(0, 1e3))})
# Rounds as train emits them: a test accuracy exactly where the round has a test loss.
history_st = st.lists(
    line_st.map(lambda d: {**d, **({"test_acc": 0.5} if "test_loss" in d else {})}), max_size=8)
