# Sourced by scripts/gpu/check.sh and remote.sh on the GPU machine: the repository root, where
# results go ($OUT), the Python there, and where the carried wheels install.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$PWD
OUT="${OUT:-$REPO/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SITE="${GPU_SITE:-/tmp/gpu-site}"
export PYTHONUNBUFFERED=1
