"""The per-round writers and the metrics line: one set of column and stage names for them all."""
from pipeline.core import keys
from pipeline.outputs import hooks


def test_metrics_csv_has_apply_seconds_for_async_runs():
    row = dict(zip(hooks.csv_header(), hooks.csv_row(
        {"round": 0, "stage_seconds": {"train": 1.0, "apply": 0.25, "waiting": 0.5}})))
    assert (row["train_seconds"], row["apply_seconds"], row["waiting_seconds"]) == (1.0, 0.25, 0.5)


def test_metrics_csv_has_a_column_for_every_stage_the_clock_reports():
    stages = [h[:-len("_seconds")] for h in hooks.csv_header() if h.endswith("_seconds")]
    assert stages == [*keys.STAGES, "waiting"]
