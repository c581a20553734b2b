"""Read scripts/gpu/check.sh's logs and write check-summary.json: each step's status and the issue's figures.

    python scripts/gpu/summarize.py OUT_DIR STATUS_FILE

Uses only the standard library and the logs, so it works whatever else failed. The figures:
pytest counts; per profile row step/kernel ms, launches, host split, float64; per benchmark config
images/s of PyTorch, Chainer's functions, ours (cuDNN + fused), single and ipm, and the ratios the
issue's goals name (ours/PyTorch >= 0.67 at batch 512, single/bare >= 0.9, ipm/single >= 0.9).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def steps(status: str) -> dict:
    """'name rc seconds' lines -> {name: {"rc": rc, "s": seconds, "timed_out": bool}}.

    >>> steps("tests 0 80\\nbench 124 110\\n")["bench"]
    {'rc': 124, 's': 110, 'timed_out': True}
    """
    out = {}
    for line in status.splitlines():
        parts = line.split()
        if len(parts) == 3:
            rc, s = int(parts[1]), int(parts[2])
            out[parts[0]] = {"rc": rc, "s": s, "timed_out": rc in (124, 137)}
    return out


def pytest_counts(log: str) -> dict:
    """The counts of pytest's last summary line.

    >>> pytest_counts("x\\n== 40 passed, 2 skipped, 1 failed in 80.1s ==\\n")
    {'passed': 40, 'skipped': 2, 'failed': 1}
    """
    lines = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", lines[-1])}


def profile_figures(log: str) -> dict:
    found = [d for d in json_lines(log) if d.get("bench") == "gpu_profile"]
    if not found:
        return {"missing": True}
    d = found[-1]

    def row(r):
        keep = ("step_ms", "kernel_ms", "gpu_ms", "launches", "memcpy", "kernel_fraction",
                "host_ms", "error")
        out = {k: r[k] for k in keep if k in r}
        if r.get("float64"):
            out["float64"] = r["float64"][:5]
        return out

    tf32 = d.get("tf32_rows", {})
    return {"rows": {k: row(r) for k, r in d.get("rows", {}).items()},
            "tf32_rows": {k: row(r) for k, r in tf32.items()} if "error" not in tf32 else tf32,
            "float64_free": d.get("float64_free"), "cudnn_speedup": d.get("cudnn_speedup")}


def bench_figures(*logs: str) -> dict:
    """{config: {run: img/s}} from the partial lines of every benchmark log, and the ratios."""
    img, errors = {}, {}
    for log in logs:
        for d in json_lines(log):
            if "partial" in d:
                img.setdefault(d["partial"], {})[d["run"]] = d.get("img_s")
                if d.get("error"):
                    errors[f"{d['partial']}/{d['run']}"] = d["error"][:200]
    ratios = {}
    for key, row in img.items():
        def ratio(a, b):
            return round(row[a] / row[b], 3) if row.get(a) and row.get(b) else None
        r = {"ours_over_torch": ratio("chainer-cudnn", "torch"),
             "chainer_over_torch": ratio("chainer", "torch"),
             "ours_over_chainer": ratio("chainer-cudnn", "chainer"),
             "single_over_ours": ratio("single", "chainer-cudnn")}
        for run in row:
            if run.startswith("ipm"):
                r[f"{run}_over_single"] = ratio(run, "single")
        ratios[key] = {k: v for k, v in r.items() if v is not None}
    return {"img_s": img, "ratios": ratios, "errors": errors}


def main(out_dir: str, status_file: str) -> int:
    out = Path(out_dir)
    probe = json_lines(read(out / "probe.log"))
    summary = {
        "steps": steps(read(Path(status_file))),
        "probe": probe[-1] if probe else read(out / "probe.log")[-600:],
        "pytest": pytest_counts(read(out / "pytest-gpu.log")),
        "profile": profile_figures(read(out / "profile.log")),
        "bench": bench_figures(read(out / "bench.log"), read(out / "bench-ipm.log")),
    }
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", read(out / "pytest-gpu.log"), re.M)
    if failed:
        summary["pytest"]["failed_tests"] = failed[:30]
    text = json.dumps(summary, indent=1)
    (out / "check-summary.json").write_text(text + "\n")
    print(text)
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
