"""The notebooks: committed with clean outputs (`make notebooks`), and each executes top to
bottom in a fresh kernel."""
from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # absent on a bare GPU machine (pytest -m gpu)

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXECUTED = REPO / "test-artifacts" / "notebooks"  # executed copies, for looking at after CI
TIMEOUT_S = 300  # per cell; each notebook takes ~1-2 minutes on 2 cores
NAMES = ["01-quickstart.ipynb", "02-strategies.ipynb", "03-cluster.ipynb",
         "04-your-model.ipynb"]


def _runner():
    """scripts/run_notebooks.py, the script `make notebooks` runs, as a module."""
    spec = importlib.util.spec_from_file_location("run_notebooks",
                                                  REPO / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What a committed output must not show: this machine's paths, a memory address, a port a
# LocalCluster picked, a traceback or a warning.
MACHINE = re.compile(r"(?<![\w.:])/(tmp|home|root|work|Users|private|var)/|\bat 0x[0-9a-f]+|"
                     r"127\.0\.0\.1:\d|localhost:\d|Traceback|Warning|WARNING", re.I)


# What a busy machine alone makes distributed say; the committed outputs have none of it (the
# runner saves nothing then), but a CI run on loaded cores may.
LOAD_ONLY = re.compile(r"Event loop was unresponsive in (Scheduler|Worker|Nanny)")


def _texts(cell) -> list[str]:
    texts = []
    for out in cell.outputs:
        texts.append(out.get("text", ""))
        texts += [out.data[m] for m in ("text/plain", "text/html") if m in out.get("data", {})]
    return texts


def test_the_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == NAMES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_have_clean_outputs(path):
    """Committed as `make notebooks` saves them: every code cell run once, in order, figures as
    PNG, and nothing of the machine that ran them, no error and no stderr (warnings)."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.cells[0].cell_type == "markdown"  # each opens by saying what it does
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name} is not saved by `make notebooks` (run it and commit the outputs)"
    assert _runner().problems(nb) == []
    for i, cell in enumerate(nb.cells):
        assert "execution" not in cell.metadata, f"cell {i} of {path.name} has timing metadata"
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            assert out.get("execution_count", cell.execution_count) == cell.execution_count
        for text in _texts(cell):
            found = MACHINE.search(text)
            assert not found, f"cell {i} of {path.name} shows {found.group()!r}: {text[:300]}"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= (4 if path.name == "01-quickstart.ipynb" else 1), "figures missing"


def test_the_runner_scrubs_what_the_machine_adds():
    runner = _runner()
    text = (f"started local cluster tcp://127.0.0.1:35785; dashboard http://127.0.0.1:45185/status"
            f"\n{REPO}/runs/notebooks/x.html /tmp/tmpab_12/images.npy "
            f"<dask.highlevelgraph.HighLevelGraph object at 0x7f3be4f43d90>")
    assert runner.scrub(text) == (
        "started local cluster tcp://127.0.0.1:PORT; dashboard http://127.0.0.1:PORT/status"
        "\nruns/notebooks/x.html <tmp> <dask.highlevelgraph.HighLevelGraph object>")
    assert not MACHINE.search(runner.scrub(text))


def _kernel_env(monkeypatch) -> None:
    # The kernel (and the LocalCluster workers it spawns) inherit this process's environment.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the notebooks switch to inline; never a GUI
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)  # 03 starts its own cluster
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # 01's MLflow cell: no server here


def execute(path: Path, workdir: Path) -> nbformat.NotebookNode:
    """Run `path` top to bottom in a fresh python3 kernel with `workdir` as its cwd; raise
    nbclient's CellExecutionError on the first failing cell."""
    import nbclient
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
    finally:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, EXECUTED / path.name)
    return nb


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == kind or kind in o.get("data", {})]


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    _kernel_env(monkeypatch)
    start = time.perf_counter()
    workdir = tmp_path / "notebooks"  # where Jupyter starts a kernel: beside the notebook
    workdir.mkdir()
    nb = execute(path, workdir)
    seconds = time.perf_counter() - start
    assert not _outputs(nb, "error")
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")
    images = _outputs(nb, "image/png")
    assert images, "no figure was shown"
    stderr = "".join(o.text for o in _outputs(nb, "stream") if o.name == "stderr")
    said = [line for line in stderr.splitlines() if line.strip() and not LOAD_ONLY.search(line)]
    assert not said, f"{path.name} printed on stderr (a warning?):\n{stderr[-3000:]}"
    if path.name == "01-quickstart.ipynb":
        assert len(images) >= 4  # grid, augmentation preview, live plot, curves
    if path.name == "03-cluster.ipynb":  # under runs/ at the root, ignored by git
        assert (tmp_path / "runs" / "notebooks" / "training-report.html").stat().st_size > 50_000
    assert not [p.name for p in workdir.iterdir()], "a notebook wrote files beside itself"
    print(f"{path.name}: {seconds:.0f} s")


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_cluster_notebook_on_a_dask_scheduler(tmp_path, monkeypatch):
    """03 with $DASK_SCHEDULER_ADDRESS: a real `dask scheduler` and two `dask worker --resources
    CPU=1` processes (the recipe in its first cell); the /training page works there too."""
    from tests.clusters import subprocess_cluster
    _kernel_env(monkeypatch)
    with subprocess_cluster(n_workers=2, resources={"CPU": 1}) as cluster:
        monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cluster.address)
        nb = execute(REPO / "notebooks" / "03-cluster.ipynb", tmp_path)
    stdout = "".join(o.text for o in _outputs(nb, "stream") if o.name == "stdout")
    assert f"connected to {cluster.address}: 2 workers" in stdout
    assert stdout.count("1 thread(s), resources CPU=1") == 2
    html = "".join(o.data["text/html"] for o in _outputs(nb, "text/html"))
    assert cluster.dashboard.replace("/status", "/training") in html
    assert (tmp_path / "runs" / "notebooks" / "training-report.html").stat().st_size > 50_000
