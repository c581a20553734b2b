#!/usr/bin/env bash
# Run on the GPU machine, in the repository root, after scripts/gpu/prepare.sh has filled .whl/:
# installs the carried wheels beside the machine's own Python/NumPy/CuPy (never a second CuPy),
# then runs the requested steps and leaves their logs and JSON in $OUT (default gpu-results/).
#
#   bash scripts/gpu/remote.sh probe tests bench train
source "$(dirname "$0")/env.sh"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/*.whl || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

probe() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'PY'
import sys, numpy, cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
from pipeline.backends.chainer import compat
reason = compat.cuda_status(check_device=True)
print(reason or compat.cuda_summary())
print("chainer import notices:", compat.import_notices)
raise SystemExit(1 if reason else 0)
PY
}

tests() {
  # A skip is an error here (tests/gpu_guard.py): every GPU test must run.
  PIPELINE_REQUIRE_GPU=1 "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs --timeout 900 \
    --ignore=tests/test_notebooks.py --junitxml="$OUT/pytest-gpu.xml" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -n 40
}

bench() {
  "$PY" benchmarks/gpu.py ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-gpu.log" | tail -n 60
  tail -n 1 "$OUT/bench-gpu.log" > "$OUT/bench-gpu.json"
}

train() {
  # The whole pipeline through the embedded cluster: CPU workers augment, one GPU worker trains.
  rm -rf /tmp/gpu-run-a /tmp/gpu-run-b
  for run in a b; do
    "$PY" -m pipeline train --data synthetic:10000:2000 --model resnet20 --strategy ipm \
      --replicas 2 --mix-every 10 --epochs 4 --batch-size 100 --optimizer momentum --lr 0.05 \
      --device gpu --out /tmp/gpu-run-$run 2>&1 | tee "$OUT/train-$run.log" | tail -n 5
  done
  "$PY" - "$OUT" <<'PY'
import json, sys, numpy as np
a, b = (np.load(f"/tmp/gpu-run-{r}/model.npz") for r in "ab")
same = sorted(a.files) == sorted(b.files) and all(a[k].tobytes() == b[k].tobytes() for k in a.files)
last = [json.loads(line) for line in open("/tmp/gpu-run-a/metrics.jsonl")][-1]
out = {"train_gpu_identical_weights": same, "test_acc": last.get("test_acc"),
       "rounds": last.get("round")}
if not same:
    out["differing"] = [k for k in a.files if a[k].tobytes() != b[k].tobytes()]
print(json.dumps(out))
json.dump(out, open(sys.argv[1] + "/train-gpu.json", "w"))
PY
}

for step in "$@"; do
  echo "== $step"
  "$step"
done
