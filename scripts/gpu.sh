#!/usr/bin/env bash
# One call on the GPU machine: build in place with the machine's own Python and
# torch, run the C tests (the arena registered with a real driver), the whole
# pytest suite (GPU tests included), and the benchmark. Everything it prints
# also lands under $OUT (default ./out).
#   device run:  bash scripts/gpu.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
nproc
python3 -c 'import torch, numpy; print("torch", torch.__version__, "numpy", numpy.__version__)'
status=0
step() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
step env FASTPIN_WERROR=1 python3 setup.py -q build_ext --inplace
step make -C tests/c test
step python3 -m pytest -q -p no:cacheprovider tests
step python3 -m fastpin.bench --json "$OUT/bench.json"
exit $status
