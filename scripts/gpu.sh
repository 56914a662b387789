#!/usr/bin/env bash
# On the GPU machine, in one call: build in place with the machine's own Python
# and torch, then run what is asked, writing everything under $OUT (default ./out).
#   bash scripts/gpu.sh              build, C tests, pytest (GPU tests included), benchmark
#   bash scripts/gpu.sh test         build, C tests, pytest
#   bash scripts/gpu.sh test FILES   build, pytest FILES (no C tests)
#   bash scripts/gpu.sh bench ARGS   build, python -m fastpin.bench ARGS --json $OUT/bench.json
#   bash scripts/gpu.sh profile ARGS build, benchmarks/profile_zero_copy.py ARGS
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
nproc
python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
status=0
step() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
step env FASTPIN_WERROR=1 python3 setup.py -q build_ext --inplace
if [ "$what" = test ] && [ $# -gt 0 ]; then
    step python3 -m pytest -q -p no:cacheprovider "$@"
elif [ "$what" = all ] || [ "$what" = test ]; then
    step make -C tests/c test
    step python3 -m pytest -q -p no:cacheprovider tests
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    # No --no-progress: one line per stage, with the seconds since the start, in the log.
    step python3 -m fastpin.bench "$@" --json "$OUT/bench.json"
fi
if [ "$what" = profile ]; then
    step env PYTHONPATH="$PWD" python3 benchmarks/profile_zero_copy.py "$@"
fi
exit $status
