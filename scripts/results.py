"""Write docs/results.md: today's headline figure of each benchmark, one table per area, made
from the JSON lines the benchmarks printed into docs/benchmarks.md (the lab notebook, in the
order the measurements were made: the last line of a benchmark is its newest result).

    python scripts/results.py          # rewrite docs/results.md
    python scripts/results.py --check  # exit 1 when docs/results.md is not what it would write

A measured figure lives once, in docs/benchmarks.md; this page is derived from it (a test
checks that it is current), and README and --help link here rather than quoting numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "results.md"
# Areas, in the order a reader asks about them: bench name -> what it compares.
AREAS = {
    "peer": "Against a plain PyTorch loop on the same cores (benchmarks/peer.py)",
    "peer step": "One training step on one core against PyTorch (benchmarks/peer.py --part step)",
    "peer train": "Time to accuracy on 2 cores against PyTorch (benchmarks/peer.py --part train)",
    "cpu_kernels": "CPU kernels against Chainer's own functions (benchmarks/cpu_kernels.py)",
    "cpu_kernels_precision": "bf16 convolutions against fp32 on CPUs (benchmarks/cpu_kernels.py --precision)",
    "cpu_kernels_threads": "One replica on two threads (benchmarks/cpu_kernels.py --threads)",
    "precision_accuracy": "bf16 against fp32 test accuracy (benchmarks/precision_accuracy.py)",
    "stock_links": "Stock Chainer links on our kernels (benchmarks/stock_links.py)",
    "speedup": "Two workers over one (benchmarks/speedup.py)",
    "overhead": "The pipeline against a bare training loop (benchmarks/overhead.py)",
    "time_to_accuracy": "Time to accuracy by strategy (benchmarks/time_to_accuracy.py)",
    "time_to_accuracy_replicas": "ipm at K = 2-16 against single, equal epochs (benchmarks/time_to_accuracy.py --part replicas)",
    "round_breakdown": "Where a round's time goes (benchmarks/round_breakdown.py)",
    "decode": "Image folders: decode and augment (benchmarks/decode.py)",
    "averaging": "Averaging against point-to-point copies (benchmarks/averaging.py)",
    "mean": "The exact mean, compiled (benchmarks/mean.py)",
    "scale_out": "Averaging across emulated hosts (benchmarks/scale_out.py)",
    "placement": "Pinned replica placement (benchmarks/placement.py)",
    "async": "Asynchronous updates (benchmarks/async.py)",
    "overlap": "Loading overlapped with training (benchmarks/overlap.py)",
    "batchnorm": "BatchNorm's compiled passes (benchmarks/batchnorm.py)",
    "cold_start": "What a run pays once (benchmarks/cold_start.py)",
}
MAX_FIELDS = 14  # cells shown per area (the lab notebook has every field)
# Benchmarks whose parts run alone: part -> the key its figures sit under. Each part shows its
# newest line, so a run of one part does not hide the other's headline.
PARTS = {"peer": {"step": "step", "train": "runs"}}


def newest(text: str) -> dict:
    """``{bench: (record, section heading)}``: each benchmark's last JSON line and where it is.

    >>> newest('## A\\n    {"bench": "x", "ratio": 1}\\n## B\\n    {"bench": "x", "ratio": 2}\\n')
    {'x': ({'bench': 'x', 'ratio': 2}, 'B')}
    """
    found, section = {}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        record = _record(line.strip())
        if record is not None and isinstance(record.get("bench"), str):
            for name in _areas(record):
                found[name] = (record, section)
    return found


def _areas(record: dict) -> list:
    """The area names of a record: its bench, or ``"<bench> <part>"`` for each part it holds.

    >>> _areas({"bench": "peer", "step": {}}), _areas({"bench": "x"})
    (['peer step'], ['x'])
    """
    parts = PARTS.get(record["bench"], {})
    return [f"{record['bench']} {p}" for p, key in parts.items() if key in record] or [
        record["bench"]]


def _record(text: str) -> dict | None:
    if not text.startswith('{"'):
        return None
    try:
        value = json.loads(text)
    except ValueError:  # an elided line ("...") quoted in prose
        return None
    return value if isinstance(value, dict) else None


def _shown(value) -> str | None:
    """A scalar as the table shows it; None for what a table cell cannot hold (lists, dicts)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str) and len(value) <= 60:
        return value.replace("|", "\\|")
    return None


# A field whose name holds one of these is a result (a ratio, a rate, an accuracy, a goal);
# the rest (batch size, repeats, versions) describes the set-up, which benchmarks.md gives.
HEADLINE = ("ratio", "speedup", "goal", "target", "acc", "seconds", "met", "gbps", "fraction",
            "error", "_vs_", "gap")


def flat(record: dict, prefix: str = "", depth: int = 3):
    """``(dotted name, cell)`` of every scalar in ``record``, nested dicts to ``depth`` levels.

    >>> list(flat({"a": 1, "b": {"c": 2.5, "d": [1]}}))
    [('a', '1'), ('b.c', '2.5')]
    """
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth > 1:
            yield from flat(value, name + ".", depth - 1)
        elif _shown(value) is not None:
            yield name, _shown(value)


def headline(record: dict) -> list:
    """The cells a results table shows: the result fields (``HEADLINE``), else the first ones."""
    cells = [c for c in flat(record) if c[0] != "bench"]
    def result(name):
        leaf = name.rsplit(".", 1)[-1]
        return leaf.endswith("_s") or any(w in leaf for w in HEADLINE)
    results = [c for c in cells if result(c[0])]
    return (results if len(results) >= 2 else cells)[:MAX_FIELDS]


def render(found: dict) -> str:
    lines = ["# Results", "",
             "Today's headline figure of each benchmark: its newest JSON line in",
             "[benchmarks.md](benchmarks.md), the lab notebook with the commands, machines and",
             "the runs before it. Generated by `python scripts/results.py`; do not edit by hand.",
             ""]
    for bench in [b for b in AREAS if b in found] + sorted(set(found) - set(AREAS)):
        record, section = found[bench]
        lines += [f"## {AREAS.get(bench, bench)}", "",
                  f"From \"{section}\".", "", "| field | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in headline(record)]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/results.md differs from what would be written")
    args = parser.parse_args(argv)
    text = render(newest(NOTEBOOK.read_text()))
    if args.check:
        current = RESULTS.read_text() if RESULTS.exists() else ""
        if current != text:
            print(f"{RESULTS} is out of date: run python scripts/results.py", file=sys.stderr)
            return 1
        return 0
    RESULTS.write_text(text)
    print(f"wrote {RESULTS} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
