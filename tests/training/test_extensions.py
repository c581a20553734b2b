"""The loop's extensions: their order, their triggers, and what anchors and checkpoints do with an
attempt; one short run with a user extension through its whole life."""
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import Config
from pipeline.core.errors import DivergenceError, Interrupted
from pipeline.core.schedule import Round
from pipeline.core.state import HostState
from pipeline.outputs.run_dir import RunDir
from pipeline.training import extensions as ext
from pipeline.training.attempt import Attempt, Pending
from pipeline.training.loop import train
from pipeline.training.triggers import Schedule
from tests.helpers import assert_same_bits, make_config


def _round(index: int) -> Round:
    return Round(index, 0, index, 1, index, True, False)


def _state(index=2, *, new=True, anchor=False, stopping=False, attempt=None, pending=None):
    line = {"round": index, "train_loss": 2.0, "train_acc": 0.25}
    return ext.RoundState(_round(index), line, new, anchor, stopping, attempt, pending)


def test_extensions_run_by_priority_in_the_order_given():
    class Mine(ext.Extension):
        priority = ext.PRIORITY_WRITER

    config = Config().replace(csv=True, tensorboard=True)
    chosen = ext.standard(config, RunDir(None, config), Schedule(4, 0, 0, 0, False),
                          hooks=[lambda line: None, Mine()], on_round=lambda line: None)
    assert [type(e).__name__ for e in chosen] == [
        "MetricsLog", "Mine", "LineHook", "LineHook", "OnRound", "ProgressBar", "Curves",
        "StrategyRecords", "Checkpoint", "Anchor"]  # no directory: no CSV, no TensorBoard


def test_a_replayed_round_reaches_the_strategy_and_the_anchor_but_no_reader():
    replayed = _state(new=False, anchor=True)
    runs = {type(e).__name__: e.trigger(replayed) for e in (
        ext.MetricsLog(None), ext.OnRound(print), ext.ProgressBar(), ext.StrategyRecords(),
        ext.Anchor())}
    assert runs == {"MetricsLog": False, "OnRound": False, "ProgressBar": False,
                    "StrategyRecords": True, "Anchor": True}


@pytest.mark.parametrize("saves, anchor, stopping, index, expected", [
    (True, True, False, 3, True),  # the last round
    (True, True, False, 1, False),  # an anchor_every anchor is not saved
    (True, True, True, 1, True),  # the last round before a stop is
    (True, False, False, 3, False),  # not gathered: nothing to save
    (False, True, True, 3, False),  # no output directory
])
def test_checkpoints_are_saved_at_anchors_the_schedule_or_a_stop_asks_for(
        tmp_path, saves, anchor, stopping, index, expected):
    out = RunDir(tmp_path if saves else None, Config())
    checkpoint = ext.Checkpoint(out, Schedule(4, 0, 0, 1, saves))
    assert checkpoint.trigger(_state(index, anchor=anchor, stopping=stopping)) is expected


def test_on_round_gets_the_line_and_no_hook_lifecycle():
    seen = []

    class Callback:
        def __call__(self, line):
            seen.append(line["round"])

        def start(self, info):
            raise AssertionError("on_round is a plain callable: never started")

    on_round = ext.OnRound(Callback())
    on_round.initialize(None)
    on_round(_state(5))
    on_round.finalize()
    assert seen == [5]


def test_a_line_hook_is_started_called_and_closed():
    calls = []

    class Hook:
        def start(self, info):
            calls.append(("start", info))

        def __call__(self, line):
            calls.append(("line", line["round"]))

        def close(self):
            calls.append(("close",))

    wrapped = ext.as_extension(Hook())
    wrapped.initialize("info")
    wrapped(_state(1))
    wrapped.finalize()
    assert calls == [("start", "info"), ("line", 1), ("close",)]


def test_curves_are_saved_when_a_stop_interrupts_the_run_only(tmp_path):
    info = SimpleNamespace(config=Config(), dataset="synthetic", n_classes=10, out=tmp_path,
                           history=[{"epoch_float": 0.5, "seconds": 1.0, "train_loss": 2.3,
                                     "train_acc": 0.1}])
    curves = ext.Curves()
    curves.initialize(info)
    curves.on_error(RuntimeError("a bug"))
    assert not (tmp_path / "curves.png").exists()
    curves.on_error(Interrupted("stopped", 130))
    assert (tmp_path / "curves.png").stat().st_size > 0


# ---- anchors on an attempt ------------------------------------------------------------------
class _Strategy:
    K = 2
    ctx = SimpleNamespace(config=Config())

    def __init__(self, value=1.0):
        self.value, self.gathered, self.rerooted = value, 0, []

    def gather(self, round_index, live):
        self.gathered += 1
        params = {"W": np.float32([self.value])}
        return HostState(round_index, [params] * 2, [None] * 2, None)

    def reroot(self, state, live):
        self.rerooted.append(state.round)
        return ("rerooted", state.round)

    def final_params(self, state):
        return dict(state.params[0])


def _anchored(strategy, index=3, stopping=False):
    attempt = Attempt(None, strategy, HostState(-1, [], [], None), plan=[], replay=False)
    pending = Pending(_round(index), "live", [], [], ())
    return attempt, _state(index, anchor=True, stopping=stopping, attempt=attempt,
                           pending=pending)


def test_checkpoint_and_anchor_gather_the_state_once_and_cut_the_lineage():
    strategy, saved = _Strategy(), []
    attempt, state = _anchored(strategy)

    class Out:  # a RunDir that keeps what it is asked to save
        def __bool__(self):
            return True

        def save_checkpoint(self, host, params):
            saved.append((host.round, float(params["W"][0])))

    for extension in (ext.Checkpoint(Out(), Schedule(4, 0, 0, 0, True)), ext.Anchor()):
        assert extension.trigger(state)
        extension(state)
    assert saved == [(3, 1.0)] and strategy.gathered == 1 and strategy.rerooted == [3]
    assert attempt.anchor.round == 3 and attempt.live == ("rerooted", 3)
    assert attempt.start.round == -1  # where the attempt began stays (a replay counts from it)


def test_a_stop_moves_the_anchor_without_new_roots():
    strategy = _Strategy()
    attempt, state = _anchored(strategy, stopping=True)
    ext.Anchor()(state)
    assert attempt.anchor.round == 3 and strategy.rerooted == []


def test_the_runs_last_round_moves_the_anchor_without_new_roots():
    """No round follows the last: scattering its state back would only cost the copies."""
    strategy = _Strategy()
    attempt, state = _anchored(strategy)
    ext.Anchor(Schedule(4, 0, 0, 0, True))(state)  # round 3 of 4
    assert attempt.anchor.round == 3 and strategy.rerooted == []
    strategy = _Strategy()
    attempt, state = _anchored(strategy)
    ext.Anchor(Schedule(8, 0, 0, 0, True))(state)  # round 3 of 8: the rounds after need roots
    assert strategy.rerooted == [3]


def test_a_diverged_state_is_never_the_anchor():
    attempt, state = _anchored(_Strategy(np.nan))
    with pytest.raises(DivergenceError, match=r"round 3 .*W is NaN or Inf"):
        ext.Anchor()(state)
    assert attempt.anchor.round == -1


def test_rounds_are_collected_one_behind_except_at_an_anchor():
    attempt = Attempt(None, _Strategy(), HostState(-1, [], [], None), plan=[], replay=False)
    attempt.pending += [Pending(_round(0), None, [], [], ())]
    assert list(attempt.due(anchors=False)) == []
    attempt.pending += [Pending(_round(1), None, [], [], ())]
    assert [p.rnd.index for p in attempt.due(anchors=False)] == [0]
    attempt.pending += [Pending(_round(2), None, [], [], ())]
    assert [p.rnd.index for p in attempt.due(anchors=True)] == [1, 2]


# ---- a run ----------------------------------------------------------------------------------
class _Watch(ext.Extension):
    """Records its life; raises from the round ``fail_at`` if given."""

    def __init__(self, fail_at=None):
        self.events, self.fail_at = [], fail_at

    def initialize(self, info):
        self.events.append(("initialize", len(info.rounds), info.first_round))

    def __call__(self, state):
        self.events.append(("round", state.rnd.index, "test_acc" in state.line))
        if state.rnd.index == self.fail_at:
            raise KeyError("stop here")

    def on_error(self, exc):
        self.events.append(("error", type(exc).__name__))

    def finalize(self):
        self.events.append(("finalize",))


BASE = {"data.source": "synthetic:128:32", "model.name": "small-cnn",
        "train.batch_size": 16, "train.epochs": 1, "augment.policy": "none",
        "progress": False, "checkpoint_every": 0, "seed": 3, "train.replicas": 2,
        "average.mix_every": "2", "eval_every": 0}


def _config(**changes) -> Config:
    return make_config(BASE, **changes)


def test_a_user_extension_lives_through_a_run_beside_on_round(dask_client):
    watch, lines = _Watch(), []
    result = train(_config(), dask_client, hooks=[watch], on_round=lines.append,
                   log=lambda message: None)
    assert lines == result.history and len(lines) == 2
    assert watch.events == [("initialize", 2, 0), ("round", 0, False), ("round", 1, True),
                            ("finalize",)]


def test_a_failing_extension_ends_the_run_and_every_extension_hears_of_it(dask_client):
    watch, other = _Watch(fail_at=0), _Watch()
    with pytest.raises(KeyError, match="stop here"):
        train(_config(), dask_client, hooks=[watch, other], log=lambda message: None)
    assert watch.events[-2:] == [("error", "KeyError"), ("finalize",)]
    assert other.events == [("initialize", 2, 0), ("error", "KeyError"), ("finalize",)]


def test_a_stop_right_after_an_anchor_saves_the_checkpoint_it_announces(tmp_path, dask_client):
    """Anchors between checkpoints: a stop requested in round 1, an anchor round, finds no round
    in flight; the anchor is saved, and a resume gives the uninterrupted weights."""
    from pipeline.core import interrupt
    config = _config(out=str(tmp_path / "run"), checkpoint_every=0, anchor_every=1,
                     **{"train.epochs": 2})
    stop = interrupt.StopRequest()

    def request_at_round_1(line):
        if line["round"] == 1:
            stop.request()

    with pytest.raises(Interrupted, match=r"interrupted after round 1 \(2 of 4 rounds done; .*\); checkpoint saved"):
        train(config, dask_client, on_round=request_at_round_1, stop=stop,
              log=lambda message: None)
    assert (tmp_path / "run" / "checkpoints" / "round-000001").is_dir()
    resumed = train(config, dask_client, resume=True, log=lambda message: None)
    whole = train(config.replace(out=None), dask_client, log=lambda message: None)
    assert_same_bits(resumed.params, whole.params)


class _Fetching:
    """A RoundGraph whose ``gather`` turns each future (a string) into its host value and
    keeps the futures it was asked for."""

    def __init__(self):
        self.fetched = []

    def gather(self, nested):
        def host(x):
            if isinstance(x, list):
                return [host(v) for v in x]
            if x is not None:
                self.fetched.append(x)
            return None if x is None else {"from": x}
        return host(nested)


@pytest.mark.parametrize("name, overrides, one_params, one_opt", [
    ("ipm", {"average.optimizer_state": "average"}, True, True),
    ("ipm", {"average.optimizer_state": "keep"}, True, False),
    ("gradient", {}, True, True),
    ("mixture", {}, False, False),
])
def test_a_strategy_fetches_what_its_replicas_share_once(name, overrides, one_params, one_opt):
    from pipeline.training import strategies
    from pipeline.training.strategies.base import Context, Live
    cls = strategies.get(name)
    config = cls.resolve(Config().replace(**{"train.replicas": 3, **overrides}))
    graph = _Fetching()
    strategy = cls(Context(config, 3, 64, 8, 10, "cpu"), graph)
    live = Live(["p0", "p1", "p2"], ["o0", "o1", "o2"], None)  # copies next to each replica
    state = strategy.gather(5, live)
    assert state.round == 5 and len(state.params) == len(state.opts) == 3
    assert graph.fetched == (["p0"] if one_params else ["p0", "p1", "p2"]) + \
        (["o0"] if one_opt else ["o0", "o1", "o2"])
    assert [p["from"] for p in state.params] == (["p0"] * 3 if one_params else ["p0", "p1", "p2"])
    assert [o["from"] for o in state.opts] == (["o0"] * 3 if one_opt else ["o0", "o1", "o2"])
