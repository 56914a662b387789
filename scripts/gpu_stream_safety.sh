#!/usr/bin/env bash
# One GPU call for the stream-safety work: build, the GPU tests, the race and
# the free's cost against this tree and against an older checkout (OLD, a
# directory with csrc/, fastpin/ and setup.py: the code before the fence), and
# the delivered GB/s of the fastpin paths for both. Results under $OUT.
set -uo pipefail
OUT=${OUT:-out}
OLD=${OLD:-}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.."
exec > >(tee -a "$OUT/stream_safety.log") 2>&1
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c 'import torch; print("torch", torch.__version__)'
status=0
step() { echo "== $*"; "$@" || { echo "!! failed ($?): $*"; status=1; }; }
step timeout 300 env FASTPIN_WERROR=1 python3 setup.py -q build_ext --inplace
step timeout 120 make -C tests/c test
step timeout 360 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_stream_safety.py \
    tests/test_gpu.py tests/test_shared_arena.py tests/test_dlpack.py}
step timeout 120 env PYTHONPATH="$PWD" python3 benchmarks/stream_race.py --json "$OUT/race_new.json"
if [ -n "$OLD" ]; then
    step timeout 300 bash -c "cd $OLD && python3 setup.py -q build_ext --inplace"
    step timeout 120 env PYTHONPATH="$OLD" python3 benchmarks/stream_race.py --json "$OUT/race_old.json"
    # The new deterministic tests against the old code: they must fail there.
    echo "== the race tests against $OLD (expected to FAIL)"
    # python -m puts the working directory first on sys.path: run from $OLD.
    (cd "$OLD" && timeout 300 python3 -m pytest -q -p no:cacheprovider \
        "$OLDPWD/tests/test_stream_safety.py" -k "${OLD_K:-side_stream or external_stream}")
    echo "(exit $? for the old code)"
fi
here=$PWD
# Old and new in turn, twice, so drift over the run shows as noise.
for round in 1 2; do
    for tree in ${OLD:+old} new; do
        dir=$here; [ "$tree" = old ] && dir=$OLD
        (cd "$dir" && step timeout 300 python3 -m fastpin.bench --case images_u8 \
            --path fastpin_pin --path loader_host --path zero_copy \
            --max-seconds 2 --no-progress --json "$OUT/bench_${tree}_$round.json") || status=1
    done
done
exit $status
