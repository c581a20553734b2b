"""`make notebook` in a real browser (issue 25): JupyterLab (the [notebook] extra) opens notebook
01 on the project's kernel, runs its first cells, and the Dask panel (dask-labextension) lists a
cluster with its dashboard panes.

The server runs from this environment with the kernel registered as `make notebook` registers it
(`ipykernel install --name python3`, here into a temporary prefix on JUPYTER_PATH), on a free
port with a token, and is stopped, with every process it started, at the end.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.clusters import REPO, browser_skip_reason, chromium_page, free_port

KERNEL_NAME = "Python 3 (dask-chainer-pipeline)"  # the Makefile's --display-name
FIRST_CELLS = 4  # the imports, load_dataset, the graph's layers and inspect_dataset


def _skip_reason() -> str | None:
    reason = browser_skip_reason()
    if reason:
        return reason
    for module in ("jupyterlab", "dask_labextension"):
        try:
            __import__(module)
        except ImportError:
            if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
                return f"{module} is not installed (pip install -e '.[notebook]')"
    return None


@pytest.fixture
def jupyterlab(tmp_path):
    """``(url, token)`` of a JupyterLab serving a copy of notebooks/ on the project's kernel."""
    root = tmp_path / "notebooks"
    shutil.copytree(REPO / "notebooks", root)
    prefix = tmp_path / "kernel-prefix"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix),
                    "--name", "python3", "--display-name", KERNEL_NAME], check=True,
                   capture_output=True, timeout=120)
    port, token = free_port(), "t" + os.urandom(8).hex()
    env = {**os.environ, "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg", "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           # the Dask panel's NEW: one in-process worker, its dashboard on a free local port,
           # linked as 127.0.0.1 (jupyter-server-proxy forwards only to localhost by default);
           # dask merges these into the shipped factory's kwargs, whose host 127.0.0.1 an
           # in-process cluster takes over TCP (its default inproc:// has no host)
           "DASK_LABEXTENSION__FACTORY__KWARGS": "{'n_workers': 1, 'processes': False, "
                                                 "'threads_per_worker': 1, "
                                                 "'protocol': 'tcp://', "
                                                 "'dashboard_address': '127.0.0.1:0'}",
           "DASK_DISTRIBUTED__DASHBOARD__LINK": "http://127.0.0.1:{port}/status"}
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--allow-root",  # CI containers run as root
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("JupyterLab did not start:\n" +
                                         (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, token
    finally:
        _stop_group(server)
        log.close()


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its kernels and clusters), SIGKILL after 30 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            continue
    server.wait(timeout=30)


def _cells_through_code_cell(n: int) -> int:
    """How many cells of notebook 01, from the top, hold its first ``n`` code cells."""
    import json
    cells = json.loads((REPO / "notebooks" / "01-quickstart.ipynb").read_text())["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    return code[n - 1] + 1


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_jupyterlab_runs_notebook_01_on_the_project_kernel_beside_the_dask_panel(jupyterlab):
    url, token = jupyterlab
    with chromium_page() as page:
        page.set_default_timeout(120_000)
        try:
            _drive(page, url, token)
        except Exception:
            page.screenshot(path=str(REPO / "test-artifacts" / "jupyterlab-failure.png"))
            raise


def _drive(page, url: str, token: str) -> None:
    if True:
        page.goto(f"{url}/lab/tree/01-quickstart.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        # the project's kernel, idle: the toolbar names it
        page.wait_for_selector(f".jp-Toolbar-kernelName:has-text('{KERNEL_NAME}')")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
        page.locator(".jp-Notebook .jp-Cell").first.click()
        for _ in range(_cells_through_code_cell(FIRST_CELLS)):  # markdown cells render, code runs
            page.keyboard.press("Shift+Enter")
            page.wait_for_timeout(300)
        # every one of the first code cells ran (an execution count) without an error
        page.wait_for_function(
            """(n) => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].slice(0, n)
                 .every(c => /\\[\\d+\\]/.test(c.querySelector('.jp-InputPrompt').textContent))""",
            arg=FIRST_CELLS)
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter"
                            ".stderr'] >> text=Traceback").count() == 0
        assert page.locator(".jp-RenderedText >> text=Error").count() == 0
        text = page.locator(".jp-Notebook").inner_text()
        assert "load-" in text and "class_counts_train" in text, text[-2000:]
        # the Dask panel: start a cluster from it, and it is listed with its dashboard panes
        page.locator(".jp-SideBar [data-id='dask-dashboard-launcher']").click()
        page.get_by_role("button", name="NEW", exact=True).click()
        item = page.wait_for_selector(".dask-ClusterListingItem")
        assert "Cluster" in item.inner_text()
        page.wait_for_selector(".dask-DashboardListing-item >> text=Task Stream")  # its panes


# --- what `make notebook` sets up, without a browser ---------------------------------------------

_FACTORY = """
import json, sys
import dask
import dask_labextension  # its config module loads labextension.yaml under what dask read
print(json.dumps([sys.prefix, dask.config.get("labextension.factory")]))
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_dask_panels_clusters_bind_to_loopback_as_make_notebook_installs_them(tmp_path):
    """`make dask-config` (a step of `make notebook` and of .ci/run) puts the panel's factory
    settings into VENV/etc/dask; a Python whose sys.prefix is VENV, importing dask-labextension
    as JupyterLab does, has a LocalCluster factory on 127.0.0.1 (distributed's default: the
    dashboard on every interface, unauthenticated)."""
    import json
    import sysconfig
    pytest.importorskip("dask_labextension")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    subprocess.run(["make", "-s", "dask-config", f"VENV={venv}"], cwd=str(REPO), check=True,
                   timeout=60)
    home = tmp_path / "home"  # no user config of ours in the way (dask's ~/.config/dask)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DASK_")},
           "HOME": str(home), "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _FACTORY], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prefix, factory = json.loads(done.stdout)
    assert Path(prefix) == venv
    assert factory == {"module": "dask.distributed", "class": "LocalCluster", "args": [],
                       "kwargs": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("uid, root", [(0, True), (1000, False)])
def test_make_notebook_serves_on_loopback_and_runs_as_root(tmp_path, uid, root):
    """JupyterLab refuses root without --allow-root (a container's usual user); and it listens
    on 127.0.0.1 whatever its config says."""
    plan = subprocess.run(["make", "-n", "-s", "notebook", f"VENV={tmp_path}", f"USER_ID={uid}"],
                          cwd=str(REPO), check=True, capture_output=True, text=True, timeout=60)
    lab = [x.split() for x in plan.stdout.splitlines() if "jupyter lab" in x]
    assert len(lab) == 1 and "--ip=127.0.0.1" in lab[0], plan.stdout
    assert ("--allow-root" in lab[0]) == root, lab
    assert "dask-config" not in plan.stdout and "etc/dask/dask-chainer-pipeline.yaml" in \
        plan.stdout  # the panel's settings are installed on the way
