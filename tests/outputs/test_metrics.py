"""The metrics line as a pure function of a round's results, and its one set of column names."""
from pipeline.core.schedule import Round
from pipeline.outputs import metrics

RND = Round(index=5, epoch=1, step=2, steps=2, global_step=10, mix=True, epoch_end=True)
TRAIN = [{"n": 8, "loss_sum": 8.0, "correct": 4}, {"n": 24, "loss_sum": 40.0, "correct": 4}]
TESTED = [{"n": 30, "loss_sum": 45.0, "correct": 6}, {"n": 10, "loss_sum": 5.0, "correct": 4}]


def _line(evaluated=(), **extra):
    return metrics.line(RND, 8, 0.05, TRAIN, list(evaluated), seconds=12.345678,
                        stage_seconds={"train": 1.0, "waiting": 0.5}, bytes_averaged=4096,
                        extra=extra)


def test_means_are_over_images_not_over_replicas_or_chunks():
    line = _line(TESTED)
    assert line["train_loss"] == 48.0 / 32 and line["train_acc"] == 8 / 32
    assert line["test_loss"] == 50.0 / 40 and line["test_acc"] == 10 / 40
    assert line["images"] == 32


def test_the_round_is_placed_by_its_last_step():
    line = _line()
    assert (line["round"], line["epoch"], line["step"]) == (5, 1, 12)
    assert line["epoch_float"] == 1.5 and line["lr"] == 0.05 and line["seconds"] == 12.3457


def test_an_evaluated_line_holds_every_column_and_others_all_but_the_test_ones():
    assert set(_line(TESTED)) == set(metrics.COLUMNS) | {"stage_seconds"}
    assert set(metrics.COLUMNS) - set(_line()) == {"test_loss", "test_acc"}
    assert all(isinstance(_line(TESTED)[c], int) for c in metrics.INTEGERS)


def test_the_strategy_fields_come_last_and_are_not_columns():
    line = _line(staleness_mean=1.5, staleness_max=2)
    assert list(line)[-2:] == ["staleness_mean", "staleness_max"]
    assert not {"staleness_mean", "staleness_max"} & set(metrics.COLUMNS)


def test_stage_names_are_the_task_stages_then_waiting():
    from pipeline.core import keys
    assert metrics.STAGES == (*keys.STAGES, "waiting")
