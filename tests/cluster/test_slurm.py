"""The Slurm recipe for real: a one-machine Slurm (scripts/slurm/single_node.sh), workers submitted
as jobs by the recipe's SLURMCluster (scripts/slurm/train_slurm.py), one job scancelled mid-run,
and the weights of a fixed in-process run, byte for byte. Needs root, slurm-wlm, munge and
dask-jobqueue; elsewhere skipped with one line, except under CI (.ci/run installs them and runs as
root), where a missing piece fails."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.cli.commands import config_from_args
from pipeline.cli.parser import build_parser
from pipeline.training.loop import train
from tests.clusters import ARTIFACTS, REPO
from tests.helpers import assert_same_bits

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = REPO / "scripts" / "slurm" / "single_node.sh"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sinfo", "sbatch", "scancel")
# 192 images, K=2 replicas of batch 8, H=1: 12 rounds, a few seconds of work on 2 cores.
ARGS = ["--data", "synthetic:192:48", "--model", "small-cnn", "--strategy", "ipm",
        "--replicas", "2", "--batch-size", "8", "--mix-every", "1", "--epochs", "1",
        "--lr", "0.02", "--augment", "cifar", "--seed", "5", "--no-progress"]
JOBS, CANCEL_AFTER = 2, 1


def _recipe():
    """scripts/slurm/train_slurm.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "train_slurm", REPO / "scripts" / "slurm" / "train_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_reason() -> str | None:
    """Why Slurm cannot start here, or None; under CI=true always None (a missing piece fails)."""
    if _in_ci():
        return None
    if os.geteuid() != 0:
        return "a one-machine Slurm needs root (slurmd starts jobs as their users) and CI is not set"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not found (scripts/slurm/single_node.sh install) "
                "and CI is not set")
    if importlib.util.find_spec("dask_jobqueue") is None:
        return "dask-jobqueue is not installed (pip install -e '.[slurm]') and CI is not set"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-machine Slurm: its ``slurm.conf`` path, also set as ``SLURM_CONF`` for the
    module. Stopped (jobs cancelled, daemons ended, directory removed) also when a test fails."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("slurm") / "cluster"
    before = os.environ.get("SLURM_CONF")
    try:
        started = subprocess.run([str(SCRIPT), "start", str(directory)], capture_output=True,
                                 text=True, timeout=120)
        if started.returncode:
            reason = f"single_node.sh start failed: {started.stderr.strip()[-600:]}"
            (pytest.fail if _in_ci() else pytest.skip)(reason)
        os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
        yield directory / "slurm.conf"
    finally:
        stopped = subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True,
                                 text=True, timeout=120)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        assert stopped.returncode == 0, stopped.stderr
        assert not directory.exists()


def _wait_for_jobs(client, conf: Path, logs: Path, timeout: float = 300) -> None:
    """Both workers' jobs running and connected; else fail with what Slurm says of them (the
    queue with its reasons, the node, the jobs' and slurmd's logs), so a CI failure tells why."""
    from distributed.exceptions import WorkerStartTimeoutError
    try:
        client.wait_for_workers(JOBS, timeout=timeout)
    except (WorkerStartTimeoutError, TimeoutError) as exc:
        def run(*args):
            done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
            return (done.stdout + done.stderr).strip()
        tails = [f"{f.name}: {f.read_text()[-800:]}" for f in sorted(logs.glob("*"))]
        slurmd = conf.parent / "slurmd.log"
        pytest.fail(f"{exc}\nsqueue: {run('squeue', '-a', '-o', '%i %T %r %M')}\n"
                    f"sinfo: {run('sinfo', '-N', '-o', '%N %T %C %e %E')}\n"
                    + "\n".join(tails) + "\nslurmd.log: "
                    + (slurmd.read_text()[-1500:] if slurmd.exists() else "none"))


def _config(**changes):
    return config_from_args(build_parser().parse_args(["train", *ARGS])).replace(**changes)


def _running_jobs() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True,
                         text=True, check=True).stdout
    return set(out.split())


class CancelOne:
    """``on_round``: after round ``after`` is reported, ``scancel`` one worker's job."""

    def __init__(self, cluster, after: int):
        self.cluster, self.after, self.cancelled = cluster, after, None

    def __call__(self, line: dict) -> None:
        if line["round"] == self.after and self.cancelled is None:
            self.cancelled = sorted(job.job_id for job in self.cluster.workers.values())[0]
            subprocess.run(["scancel", self.cancelled], check=True, timeout=30)


def test_the_recipes_worker_flags():
    recipe = _recipe()
    assert recipe.worker_args(1, gpu=False) == [
        "--preload", "pipeline.cluster.worker_setup", "--resources", "CPU=1"]
    assert recipe.worker_args(4, gpu=True)[-2:] == ["--resources", "GPU=1"]
    args, rest = recipe.parse(["--jobs", "3", "--gpu", "--", "--data", "cifar10"])
    assert (args.jobs, args.gpu, rest) == (3, True, ["--data", "cifar10"])


def test_slurm_jobs_with_one_scancelled_give_the_fixed_runs_bits(slurm, tmp_path, dask_client):
    reference = train(_config(), client=dask_client).params
    import distributed
    recipe = _recipe()
    lines: list[str] = []
    with recipe.slurm_cluster(cores=1, memory="2GB", scheduler_host="127.0.0.1",
                              log_directory=str(tmp_path / "jobs"), death_timeout=30,
                              prologue=[f"export PYTHONPATH={REPO}", "export CUDA_VISIBLE_DEVICES="]
                              ) as cluster:
        script = cluster.job_script()
        assert "#SBATCH --requeue" in script and "--preload pipeline.cluster.worker_setup" in script
        cluster.scale(jobs=JOBS)
        with distributed.Client(cluster, set_as_default=False) as client:
            _wait_for_jobs(client, slurm, tmp_path / "jobs")
            jobs = {job.job_id for job in cluster.workers.values()}
            assert jobs <= _running_jobs(), (jobs, _running_jobs())
            cancel = CancelOne(cluster, CANCEL_AFTER)
            config = _config(**{"cluster.connect_timeout": 5.0})
            result = train(config, client=client, log=lines.append, on_round=cancel)
            assert cancel.cancelled in jobs, lines
            assert cancel.cancelled not in _running_jobs()
            assert len(client.scheduler_info(n_workers=-1)["workers"]) == JOBS - 1, lines
    assert_same_bits(result.params, reference, context=(cancel.cancelled, lines))
    # .ci/run prints this after the suite and fails without it: CI shows the test ran.
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "slurm-run.txt").write_text(
        f"Slurm jobs {sorted(jobs)}, job {cancel.cancelled} scancelled after round "
        f"{CANCEL_AFTER}; final weights equal the fixed 2-worker run's, byte for byte\n"
        + "".join(f"  {line}\n" for line in lines))
