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


# --- hostile input, round three: outputs never leave OUT, a dead writer never hangs -----------

import errno  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from pipeline.core.config import Config  # noqa: E402
from pipeline.core.errors import OutputError  # noqa: E402


def _info(tmp_path):
    return hooks.RunInfo(client=None, config=Config(), out=tmp_path, rounds=[], per_epoch=1,
                         n_classes=10, dataset="x", history=[], log=print)


@pytest.mark.timeout(60)
def test_a_full_disk_under_tensorboard_is_one_error_not_a_hang(tmp_path, monkeypatch, capfd):
    from tensorboardX import event_file_writer

    real, written = event_file_writer.EventsWriter.write_event, []

    def full(self, event):  # the disk fills after a few events
        written.append(event)
        if len(written) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, event)
    monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", full)
    log = hooks.TensorBoardLog(tmp_path / "tensorboard")
    log.start(_info(tmp_path))
    start = time.monotonic()
    line = {"step": 1, "train_loss": 1.0, "train_acc": 0.5, "lr": 0.1,
            "stage_seconds": {"train": 1.0}}
    with pytest.raises(OutputError, match=r"tensorboard: No space left on device"):
        for step in range(200):  # 1000 events: 100 times what the writer's queue holds
            log(dict(line, step=step))
            time.sleep(0.01)
    log.close()  # returns: the dead thread is never asked to take a stop event
    assert time.monotonic() - start < 30
    assert "Traceback" not in capfd.readouterr().err  # the thread ended quietly


@pytest.mark.parametrize("make", [
    lambda p, elsewhere: os.symlink(elsewhere, p),
    lambda p, elsewhere: os.mkfifo(p),
], ids=["link", "fifo"])
def test_outputs_appended_to_never_follow_a_link_or_open_a_fifo(tmp_path, make):
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_text("keep\n")
    out = tmp_path / "out"
    out.mkdir()
    make(out / "metrics.csv", elsewhere)
    with pytest.raises(OutputError, match=r"metrics.csv: is (a symbolic link; a run writes only "
                                          r"inside its directory|a FIFO \(named pipe\), expected)"):
        hooks.CSVLog(out / "metrics.csv")({"round": 0})
    assert elsewhere.read_text() == "keep\n"


def test_a_linked_tensorboard_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "tensorboard")
    with pytest.raises(OutputError, match="tensorboard: is a symbolic link"):
        hooks.TensorBoardLog(tmp_path / "tensorboard").start(_info(tmp_path))
    assert not list((tmp_path / "elsewhere").iterdir())
