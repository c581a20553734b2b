"""Regenerate the outputs of notebooks/*.ipynb in place, so that a reader on the web sees them.

Usage: python scripts/run_notebooks.py [NOTEBOOK ...]   (default: every notebook; `make notebooks`)

Each notebook runs top to bottom in a fresh `python3` kernel started in notebooks/ (as JupyterLab
does), on a LocalCluster it starts itself. The saved copy is made stable, so that rerunning it
changes only what a run really changes (seconds, async's accuracies): execution counts 1, 2, ...
in cell order, no timing metadata, one output per run of stdout, and no machine details in the
text: the repository's absolute path, temporary directories, memory addresses and the ports a
LocalCluster picks at random are scrubbed. Images are PNG (`%matplotlib inline`'s default). A
notebook that shows an error, a traceback or anything on stderr (a warning) is not written: fix
the notebook instead.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
TIMEOUT_S = 300  # per cell

# (pattern, replacement) applied to every text output, in order.
SCRUB = [
    (re.compile(re.escape(str(REPO)) + r"/?"), ""),
    (re.compile(r"(?<![\w.])/tmp/[^\s'\"<>]*"), "<tmp>"),
    (re.compile(r" at 0x[0-9a-fA-F]+"), ""),
    (re.compile(r"\b(127\.0\.0\.1|localhost):\d{2,5}\b"), r"\1:PORT"),
]


def scrub(text: str) -> str:
    for pattern, replacement in SCRUB:
        text = pattern.sub(replacement, text)
    return text


def kernel_env() -> None:
    # The kernel and the LocalCluster workers it spawns inherit this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")]))
    os.environ["MPLBACKEND"] = "Agg"            # the notebooks switch to inline; never a GUI
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ.pop("DASK_SCHEDULER_ADDRESS", None)  # each notebook starts its own LocalCluster


def problems(nb) -> list[str]:
    """What must not be committed: errors, tracebacks, stderr (warnings)."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                found.append(f"cell {i}: {out.ename}: {out.evalue}")
            elif out.output_type == "stream" and out.name == "stderr":
                found.append(f"cell {i} wrote to stderr: {out.text.strip()[:500]}")
    return found


def merge_streams(outputs: list) -> list:
    """Consecutive stream outputs of one name as one: how the kernel split a cell's stdout into
    messages depends on when it flushed, which changes from run to run."""
    merged = []
    for out in outputs:
        previous = merged[-1] if merged else None
        if (out.output_type == "stream" and previous is not None
                and previous.output_type == "stream" and previous.name == out.name):
            previous.text += out.text
        else:
            merged.append(out)
    return merged


def normalize(nb) -> None:
    """Execution counts 1..n, no timing metadata, scrubbed text outputs (in place)."""
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.outputs = merge_streams(cell.outputs)
        for out in cell.outputs:
            if "execution_count" in out:
                out.execution_count = count
            if out.output_type == "stream":
                out.text = scrub(out.text)
            for mime in ("text/plain", "text/html"):
                if mime in out.get("data", {}):
                    out.data[mime] = scrub(out.data[mime])
            out.get("metadata", {}).pop("transient", None)
    nb.metadata.pop("widgets", None)


def run(path: Path) -> float:
    import nbclient
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    seconds = time.perf_counter() - start
    bad = problems(nb)
    if bad:
        raise SystemExit(f"{path.name} not written:\n  " + "\n  ".join(bad))
    normalize(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str]) -> int:
    kernel_env()
    paths = [Path(a).resolve() for a in argv] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"{path.relative_to(REPO)}: {run(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
