#!/usr/bin/env bash
# One GPU round trip for issue 27, run on the GPU machine in the repository root with .whl/ carried
# (scripts/gpu/prepare.sh fills it): ~5.5 minutes on an H100 (278 s there on 2026-11-26, with
# the bench step cut at its old 100 s limit; it needs ~115).
#
#   bash scripts/gpu/check.sh
#
# Steps, each bounded by `timeout` and independent of the others' success:
#   install  the carried wheels (dask, distributed, chainer, nvidia-cudnn-frontend...) into $SITE
#   probe    versions, whether the cuDNN frontend loads, one convolution and BatchNorm through it
#   tests    PIPELINE_REQUIRE_GPU=1 pytest -m "gpu and not slow" (CHECK_SLOW=1: -m gpu)
#   profile  benchmarks/gpu_profile.py (where a step's time goes; CUPY_TF32=1 rows; no float64)
#   bench    benchmarks/gpu.py, bare loops (PyTorch, Chainer's functions, ours) and single
#   ipm      benchmarks/gpu.py, ipm K=2/K=4 as GPU worker processes, batch 100
#   summary  check-summary.json: every step's status and the figures the issue asks for
# Files in $OUT (flat, 7): check-summary.json probe.log pytest-gpu.log profile.log bench.log
# bench-ipm.log install.log. Expected ~5.5 minutes; with every step at its limit, 9.
# Timeouts (seconds) can be changed: T_TESTS T_PROFILE T_BENCH T_IPM. A second call can run some
# steps only: CHECK_STEPS="install tests" (default: all; the summary always runs).
source "$(dirname "$0")/env.sh"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
unset CUPY_TF32 PIPELINE_GPU_KERNELS PIPELINE_FUSED_UPDATE
STATUS="$OUT/.status"
: > "$STATUS"

step() {  # step NAME SECONDS LOG COMMAND...: run bounded, record rc and seconds, never stop
  local name=$1 limit=$2 log=$3; shift 3
  case " ${CHECK_STEPS:-install probe tests profile bench ipm} " in
    *" $name "*) ;;
    *) echo "== $name: not in CHECK_STEPS"; return 0 ;;
  esac
  local start=$SECONDS
  echo "== $name (at most ${limit}s)"
  if declare -F "$1" > /dev/null; then  # a function of this script: timeout needs a process
    timeout --kill-after=10 "$limit" bash -c "$*" > "$log" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  fi
  local rc=$?
  echo "$name $rc $((SECONDS - start))" >> "$STATUS"
  tail -n "${TAIL_LINES:-25}" "$log"
  echo "== $name: rc $rc in $((SECONDS - start))s"
}

install_wheels() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl && ls "$SITE" | tr '\n' ' ' && echo
}

probe_stack() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'PY'
import json, sys, time
import numpy, cupy
out = {"python": sys.version.split()[0], "numpy": numpy.__version__, "cupy": cupy.__version__}
from pipeline.backends.chainer import compat
out["cuda_status"] = compat.cuda_status(check_device=True) or compat.cuda_summary()
from pipeline.backends.chainer import gpu_kernels
from pipeline.backends.chainer.gpu_kernels import graphs
start = time.perf_counter()
cudnn = graphs.load()
out["frontend"] = (f"cudnn-frontend {cudnn.__version__}, cuDNN {cudnn.backend_version()}"
                   if cudnn else graphs.unavailable_reason())
out["frontend_load_s"] = round(time.perf_counter() - start, 2)
if cudnn:
    from pipeline.backends.chainer.compat import F, chainer
    from pipeline.backends.chainer import cpu_kernels
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((4, 8, 16, 16)).astype(numpy.float32))
    w = cupy.asarray(rng.standard_normal((16, 8, 3, 3)).astype(numpy.float32) * 0.1)
    try:
        y = gpu_kernels.convolution_2d(x, w, None, 1, 1)
        with chainer.using_config("gpu_kernels", "chainer"):
            ref = F.convolution_2d(x, w, None, 1, 1)
        out["conv"] = ("not built" if y is None else
                       float(abs(y.array - ref.array).max() / abs(ref.array).max()))
    except Exception as exc:
        out["conv"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        bn = cpu_kernels.BatchNormalization(8)
        bn.to_device("@cupy:0")
        with chainer.using_config("train", True):
            y = bn(x)
        out["bn_layout"] = getattr(y.creator, "layout", "chainer (not built)")
    except Exception as exc:
        out["bn_layout"] = f"{type(exc).__name__}: {exc}"[:300]
    out["graphs"] = dict(graphs.stats)
    out["graph_errors"] = dict(list(graphs.errors.items())[:6])
print(json.dumps(out))
PY
}

gpu_tests() {
  local marks="gpu and not slow"
  [ "${CHECK_SLOW:-0}" = 1 ] && marks="gpu"
  PIPELINE_REQUIRE_GPU=1 "$PY" -m pytest -p no:cacheprovider -m "$marks" -q -rs --durations=8 \
    --ignore=tests/test_notebooks.py tests
}

export REPO OUT PY SITE
export -f install_wheels probe_stack gpu_tests
step install 60 "$OUT/install.log" install_wheels
step probe 60 "$OUT/probe.log" probe_stack
step tests "${T_TESTS:-100}" "$OUT/pytest-gpu.log" gpu_tests
step profile "${T_PROFILE:-70}" "$OUT/profile.log" "$PY" benchmarks/gpu_profile.py \
  --steps 20 --warmup 5 --child-timeout 35
step bench "${T_BENCH:-150}" "$OUT/bench.log" "$PY" benchmarks/gpu.py --steps 80 --seconds 1.0 \
  --skip-typecheck --skip-ipm --single-images 10000 --rounds 4
step ipm "${T_IPM:-70}" "$OUT/bench-ipm.log" "$PY" benchmarks/gpu.py --skip-bare --skip-single \
  --batches 100 --variants processes --replicas 2,4 --rounds 2

# the summary reads the logs above and $STATUS; it prints check-summary.json, which it writes
echo "== summary"
timeout 30 "$PY" scripts/gpu/summarize.py "$OUT" "$STATUS" || echo "summary failed: rc $?"
rm -f "$STATUS"
ls -la "$OUT"
