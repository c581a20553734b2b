"""Browser test: headless Chromium opens the dashboard of a running job and finds the stage names."""
from __future__ import annotations

import time

import pytest

from pipeline import cluster
from pipeline.config import ClusterConfig
from tests.pipeline.clusters import ARTIFACTS, browser_skip_reason, open_dashboard

STAGES = {"load", "augment", "train", "average", "evaluate"}
TOKEN = "0123abcd"  # an 8-hex run token: key_split drops it, so the dashboard shows the bare stage


# Stand-ins for the pipeline's stages: same names, same key shapes, a little sleep so that the
# task stream has something to draw. The real training job can replace `stage_graph`.
def load(i):
    time.sleep(0.05)
    return i


def augment(x, r, k):
    time.sleep(0.1)
    return x + r


def train(batch, state, r, k):
    time.sleep(0.2)
    return batch + (state or 0) + k


def average(*xs):
    time.sleep(0.05)
    return sum(xs) / len(xs)


def evaluate(x):
    time.sleep(0.05)
    return x


def stage_graph(token: str = TOKEN, replicas: int = 4, rounds: int = 2, fan_in: int = 2):
    """A dask graph shaped like a training run, keys named by stage; returns (graph, output keys).

    ("load-T", i) -> ("augment-T", r, k) -> ("train-T", r, k) -> ("average-T", r, level, i)
    tree -> ("evaluate-T", r); round r + 1 augments the loaded shard again and trains it from
    the round-r average.
    """
    dsk = {(f"load-{token}", k): (load, k) for k in range(replicas)}
    state = None
    for r in range(rounds):
        level = [(f"train-{token}", r, k) for k in range(replicas)]
        for k in range(replicas):
            dsk[(f"augment-{token}", r, k)] = (augment, (f"load-{token}", k), r, k)
            dsk[level[k]] = (train, (f"augment-{token}", r, k), state, r, k)
        depth = 0
        while len(level) > 1:
            groups = [level[i:i + fan_in] for i in range(0, len(level), fan_in)]
            level = [(f"average-{token}", r, depth, i) for i in range(len(groups))]
            for key, group in zip(level, groups):
                dsk[key] = (average, *group)
            depth += 1
        state = level[0]
        dsk[(f"evaluate-{token}", r)] = (evaluate, state)
    return dsk, [(f"evaluate-{token}", r) for r in range(rounds)]


def test_stage_graph_keys_are_named_by_stage():
    from dask.utils import key_split
    dsk, outputs = stage_graph()
    assert {key_split(key) for key in dsk} == STAGES
    assert outputs == [("evaluate-" + TOKEN, 0), ("evaluate-" + TOKEN, 1)]
    assert ("average-" + TOKEN, 1, 1, 0) in dsk  # 4 replicas, fan-in 2: two levels
    assert dsk[("train-" + TOKEN, 1, 3)][2] == ("average-" + TOKEN, 0, 1, 0)


@pytest.mark.browser
@pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))
def test_dashboard_task_stream_shows_the_stages():
    dsk, outputs = stage_graph()
    shot = ARTIFACTS / "dashboard.png"
    with cluster.connect(ClusterConfig(workers=2, threads_per_worker=1)) as client:
        link = cluster.describe(client)["dashboard"]
        assert link.startswith("http://127.0.0.1:")
        # Open the page first: that starts the scheduler's task-stream recording.
        with open_dashboard(link) as dash:
            futures = client.get(dsk, outputs, sync=False)
            names = dash.wait_for_stages(STAGES, timeout=30)
            progress = dash.progress_names()
            dash.screenshot(shot)
            results = client.gather(futures)
    assert STAGES <= names, f"task stream shows {sorted(names)}"
    assert STAGES <= progress, f"progress bars show {sorted(progress)}"
    assert len(results) == 2
    assert shot.stat().st_size > 10_000  # a real PNG of the page, not an empty one
