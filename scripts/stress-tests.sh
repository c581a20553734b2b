#!/usr/bin/env bash
# Run the test suite N times, alternating OpenBLAS kernels and CPU load, and print the failure
# count per test. A test that passes only on one kernel, or only on quiet cores, shows up here.
#
#   scripts/stress-tests.sh [N] [pytest args...]     (N defaults to 5; run from the repository)
#
# Run i uses kernel KERNELS[i mod 3] (OPENBLAS_CORETYPE: Haswell, SkylakeX, Sandybridge; AMD Zen
# runs OpenBLAS's Haswell kernels) and, on every other run, one busy loop per core for the whole
# run. A run that ends without pytest's summary (a hang killed by RUN_TIMEOUT_S, a crash) counts
# as a failure of "<run i: no summary>". Exit status: 0 when every run passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

N="${1:-5}"
shift || true
PY="${PY:-.venv/bin/python}"
KERNELS=(${KERNELS:-Haswell SkylakeX Sandybridge})
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-2400}"
OUT="$(mktemp -d -t stress-tests.XXXXXX)"
LOAD_PIDS=()

stop_load() {
  for pid in "${LOAD_PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null; done
  LOAD_PIDS=()
}
trap 'stop_load' EXIT INT TERM

start_load() {
  for _ in $(seq "$(nproc)"); do
    ( trap 'exit 0' TERM; while :; do :; done ) &
    LOAD_PIDS+=("$!")
  done
}

for i in $(seq 0 $((N - 1))); do
  kernel="${KERNELS[$((i % ${#KERNELS[@]}))]}"
  load=$(( i % 2 ))
  [ "$load" = 1 ] && start_load
  arch=$(OPENBLAS_CORETYPE="$kernel" "$PY" -c \
    "import numpy, threadpoolctl; print(threadpoolctl.threadpool_info()[0].get('architecture'))" 2>/dev/null)
  echo "run $((i + 1))/$N: OPENBLAS_CORETYPE=$kernel (OpenBLAS runs $arch), load=$load" >&2
  start=$(date +%s)
  OPENBLAS_CORETYPE="$kernel" timeout -k 30 "$RUN_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT/run-$i.xml" "$@" >"$OUT/run-$i.log" 2>&1
  rc=$?
  stop_load
  echo "  rc=$rc in $(( $(date +%s) - start )) s; $(tail -n 1 "$OUT/run-$i.log")" >&2
  echo "$i $kernel $load $rc" >>"$OUT/runs.txt"
done

"$PY" - "$OUT" <<'PY'
import collections, json, pathlib, sys
import xml.etree.ElementTree as ET

out = pathlib.Path(sys.argv[1])
failures, runs = collections.Counter(), []
for line in (out / "runs.txt").read_text().splitlines():
    i, kernel, load, rc = line.split()
    xml = out / f"run-{i}.xml"
    failed, total = [], 0
    if xml.exists() and xml.stat().st_size:
        for case in ET.parse(xml).iter("testcase"):
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    else:
        failed.append(f"<run {i}: no summary (rc {rc})>")
    failures.update(failed)
    runs.append({"run": int(i), "kernel": kernel, "load": bool(int(load)), "rc": int(rc),
                 "tests": total, "failed": len(failed)})
for run in runs:
    print(f"run {run['run'] + 1}: {run['kernel']:<11} load={int(run['load'])} "
          f"tests={run['tests']} failed={run['failed']} rc={run['rc']}")
print(f"failures per test over {len(runs)} runs:" if failures else
      f"no failures over {len(runs)} runs")
for name, count in failures.most_common():
    print(f"  {count}  {name}")
print(json.dumps({"runs": len(runs), "failed_runs": sum(r["failed"] > 0 for r in runs),
                  "failures": sum(failures.values()), "logs": str(out)}))
sys.exit(1 if failures else 0)
PY
