#!/usr/bin/env bash
# On the GPU machine, in one call: build in place with the machine's own Python
# and torch, then run what is asked, writing everything under $OUT (default ./out).
#   bash scripts/gpu.sh              build, C tests, pytest (GPU tests included), benchmark
#   bash scripts/gpu.sh test         build, C tests, pytest
#   bash scripts/gpu.sh test FILES   build, pytest FILES (no C tests)
#   bash scripts/gpu.sh bench ARGS   build, python -m fastpin.bench ARGS --json $OUT/bench.json
#   bash scripts/gpu.sh profile ARGS build, benchmarks/profile_zero_copy.py ARGS
#   bash scripts/gpu.sh measure [pin|loader]  build, then
#                                pin: the GPU tests of pin_memory's C fast path,
#                                the Loader's modes and the core, pin_small.py,
#                                pin_parts.py, pin_steady.py, pool_spin.py (the copy
#                                pool's spinning workers: time and CPU), driver_calls.c,
#                                the pin table (64 KB to 1 GB) with
#                                streaming stores on and off (about 5 minutes);
#                                loader: zero-copy CPU per batch by thread (15
#                                workers), zero-copy default against hand-sized
#                                with streaming on and off, the training step
#                                table, training resnet18 at 8 and 15 workers
#                                (about 7 minutes); neither: both
#   bash scripts/gpu.sh install [tests|bench|lightning]  build, then
#                                tests: the GPU tests and tests/test_install.py (install()'s
#                                zero-copy with DataLoader's real pin thread); bench: every
#                                workload case through pin_memory, install and zero_copy at
#                                15 workers, and the training table's columns of the same
#                                three paths (about 6 minutes); lightning: Lightning's
#                                Trainer through stock and install()
#                                (benchmarks/lightning_install.py); none: all three
#                                (over the device tool's 600 s: one call each); check:
#                                the queued-copies GPU test as the code was and as it is,
#                                install()'s CPU by thread, the image cases, the GPU tests
#   bash scripts/gpu.sh pin [bench|test] [ARGS]  build, then
#                                bench: benchmarks/pin_cutover.py --recommend ARGS (pin_memory's
#                                copy strategies against torch's pin and memcpy, 64 KB to 1 GB,
#                                cache-hot and cache-cold; its own budget 270 s, about 5 minutes
#                                in all) into $OUT/pin_cutover.json; test: the copy pool's C
#                                tests plain, under ASan+UBSan and under TSan, and
#                                tests/test_copier_spin.py; neither: both (over the device
#                                tool's 600 s at worst: one call each)
#   bash scripts/gpu.sh engine       build, then (about 7 minutes): the GPU tests of the
#                                delivery engine (install(device=...), Loader(device),
#                                stream safety, zero-copy); main-process CPU per batch
#                                by thread for Loader(device), install(device) and
#                                install() on tokens, token windows, float32 images
#                                and recsys, with torch's own per-batch floor
#                                (benchmarks/install_threads.py)
#   bash scripts/gpu.sh spy [CASES]  build, then py-spy over install_threads.py's install(device)
#                                path, one case a run (default images_f32 tokens), and
#                                where the samples go (scripts/spy_top.py); needs
#                                .tools/py-spy carried (about 2 minutes a case)
#   bash scripts/gpu.sh parts [CASES] build, then benchmarks/delivery_parts.py: the delivery
#                                step's CUDA and torch primitives timed alone, then
#                                install(device)'s parts per batch, wrapped in timers, on
#                                CASES (default tokens images_f32 recsys; about 3 minutes)
#   bash scripts/gpu.sh trainers     build, then Lightning's Trainer (resnet18) and HF's Trainer
#                                (GPT-2 from a config) through stock, install() and
#                                install(device="cuda"), Lightning also through Loader(device)
#                                and the GPU-resident upper bound (about 8 minutes)
#   bash scripts/gpu.sh omp          build, then the torch span (256 KiB-16 MiB) copied by
#                                torch's OpenMP team directly against through its copy_:
#                                the span's GPU tests, the pin table (default, copy_,
#                                the span from 128 KiB; 128 KiB to 16 MiB), install() with num_workers=0
#                                on tokens, the default and copy_ (about 5 minutes);
#                                `omp short`: default and copy_ alone, to 8 MiB (about 3)
#   bash scripts/gpu.sh team [DIR [NAME=VALUE ...]]  build, then benchmarks/team_copy.c with
#                                a thread per CPU (a copy team against OpenMP's, memcpy
#                                against an AVX2 loop, hot and cold); with DIR (a tree with
#                                csrc/, fastpin/, setup.py: a copy pool under trial) that
#                                build's pin table, torch's copy_ against the pool spinning
#                                in slices from 16 KiB, NAME=VALUE set for it (about 5 minutes)
#   bash scripts/gpu.sh streams [OLD] build, the stream-safety tests under both fences
#                                (cuCtxRecordEvent, FASTPIN_FENCE=sync) and
#                                benchmarks/stream_race.py; with OLD (a directory
#                                holding an older checkout's csrc/, fastpin/ and
#                                setup.py) the race there too, and its tests, which
#                                must fail there
#   bash scripts/gpu.sh percall      build, then (about 8 minutes): what one pin_memory call
#                                and one delivered batch cost, in this order: the GPU tests
#                                of pin_default, the index and result queues and install()'s
#                                leaks, pin_parts.py, driver_calls.c, the pin table at the
#                                default settings (benchmarks/pin_cutover.py), main-process
#                                CPU per batch by thread on tokens and recsys
#                                (install_threads.py), the small-batch cases at 15 workers
#                                through stock, the prefetcher, install(), install(device)
#                                and the zero-copy Loader
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
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
# Every step has a time limit (STEP_TIMEOUT seconds, default 900), so one hang
# does not eat the call; steps that set their own `timeout` get the smaller.
step() { echo "== $* (${SECONDS}s)"; timeout "${STEP_TIMEOUT:-900}" "$@" || { echo "!! failed ($?): $*"; status=1; }; }
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
if [ "$what" = streams ]; then
    old=${1:-}
    step timeout 180 make -C tests/c test
    step timeout 120 env FASTPIN_FENCE=sync tests/c/build/test/test_arena
    for fence in event sync; do
        step timeout 300 env FASTPIN_FENCE=$fence python3 -m pytest -q -p no:cacheprovider \
            tests/test_stream_safety.py
        step timeout 120 env FASTPIN_FENCE=$fence PYTHONPATH="$PWD" \
            python3 benchmarks/stream_race.py --json "$OUT/race_$fence.json"
    done
    if [ -n "$old" ]; then
        step timeout 300 bash -c "cd $old && python3 setup.py -q build_ext --inplace"
        step timeout 120 env PYTHONPATH="$old" python3 benchmarks/stream_race.py \
            --json "$OUT/race_old.json"
        echo "== the race tests against $old (expected to FAIL there)"
        # python -m puts the working directory first on sys.path: run from $old.
        (cd "$old" && timeout 300 python3 -m pytest -q -p no:cacheprovider \
            "$OLDPWD/tests/test_stream_safety.py" -k "side_stream or external_stream")
        echo "(exit $? for the old code)"
    fi
fi
if [ "$what" = measure ]; then
    # Over 10 minutes in all: the device tool's calls are cut at 600 s, so
    # run it in two calls, `measure pin` then `measure loader`.
    part=${1:-all}
    if [ "$part" = all ] || [ "$part" = pin ]; then
        step timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu.py \
            tests/test_stream_safety.py tests/test_loader.py tests/test_loader_stats.py \
            tests/test_zero_copy.py tests/test_gpu_stale.py
        step timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_pin_batch.py
        step timeout 120 env PYTHONPATH="$PWD" python3 benchmarks/pin_small.py
        step timeout 60 env PYTHONPATH="$PWD" python3 benchmarks/pin_parts.py --sizes 65536 1048576
        step timeout 60 env PYTHONPATH="$PWD" python3 benchmarks/pin_steady.py --windows 6
        step timeout 90 env PYTHONPATH="$PWD" python3 benchmarks/pool_spin.py --json "$OUT/pool_spin.json"
        step timeout 60 bash -c "gcc -O2 -I${CUDA_HOME:-/usr/local/cuda}/include -o /tmp/driver_calls \
            benchmarks/driver_calls.c -ldl && /tmp/driver_calls"
        for s in 1 0; do
            step timeout 150 env FASTPIN_STREAMING=$s python3 -m fastpin.bench --case pin_sizes \
                --sizes 0.0625 0.25 1 2 16 64 256 1024 --json "$OUT/pin_sizes_streaming$s.json"
        done
    fi
    if [ "$part" = all ] || [ "$part" = loader ]; then
        step timeout 150 env PYTHONPATH="$PWD" python3 benchmarks/zero_copy_cpu.py --workers 15 \
            --json "$OUT/zero_copy_cpu.json"
        for s in 1 0; do
            step timeout 100 env FASTPIN_STREAMING=$s PYTHONPATH="$PWD" \
                python3 benchmarks/zero_copy_default.py --workers 15 --batches 1500
        done
        step timeout 120 python3 -m fastpin.bench --case train_step --json "$OUT/train_step.json"
        step timeout 300 python3 -m fastpin.bench_train --workers 8 --workers 15 --steps 30
    fi
fi
if [ "$what" = install ]; then
    part=${1:-all}
    if [ "$part" = all ] || [ "$part" = tests ]; then
        step timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests
        step timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_install.py \
            tests/test_zero_copy_sizing.py
    fi
    if [ "$part" = all ] || [ "$part" = bench ]; then
        step timeout 240 python3 -m fastpin.bench --case images_u8 --case images_f32 \
            --case tokens --case recsys --case token_windows --path pin_memory --path install \
            --path zero_copy --workers 15 --max-seconds 2 --no-progress --json "$OUT/install.json"
        step timeout 200 python3 -m fastpin.bench_train --workers 15 --steps 30 \
            --path pin_memory --path zero_copy --path install
    fi
    if [ "$part" = check ]; then
        t=tests/test_install.py::test_copies_queued_behind_the_gpu_wait_for_it_never_fall_back_for_good
        echo "== the queued-copies test as the code was (workers fall back at once): expected to FAIL"
        PYTHONPATH=scripts timeout 60 python3 -m pytest -q -p no:cacheprovider -p old_free_wait "$t" | tail -3
        step timeout 60 python3 -m pytest -q -p no:cacheprovider "$t"
        step timeout 60 env PYTHONPATH="$PWD" python3 benchmarks/install_threads.py --batches 100 --path install
        step timeout 120 python3 -m fastpin.bench --case images_u8 --case images_f32 --path install \
            --path zero_copy --workers 15 --max-seconds 2 --no-progress --json "$OUT/install_check.json"
        step timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests
    fi
    if [ "$part" = all ] || [ "$part" = lightning ]; then
        step timeout 300 env PYTHONPATH="$PWD" python3 benchmarks/lightning_install.py \
            --workers 15 --steps 60 --json "$OUT/lightning_install.json"
    fi
fi
if [ "$what" = pin ]; then
    part=${1:-all}
    [ $# -gt 0 ] && shift
    if [ "$part" = all ] || [ "$part" = test ]; then
        step timeout 480 make -C tests/c test asan tsan TESTS=test_copier
        step timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_copier_spin.py
    fi
    if [ "$part" = all ] || [ "$part" = bench ]; then
        step timeout 420 env PYTHONPATH="$PWD" python3 benchmarks/pin_cutover.py --recommend "$@" \
            --json "$OUT/pin_cutover.json"
    fi
fi
if [ "$what" = engine ]; then
    # The workload table and the training table of the same paths are the
    # default bench run's (`bash scripts/gpu.sh bench`): not repeated here.
    step timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short \
        tests/test_delivery_gpu.py tests/test_stream_safety.py tests/test_loader.py \
        tests/test_loader_stats.py tests/test_install.py tests/test_zero_copy.py \
        tests/test_zero_copy_reuse.py tests/test_zero_copy_sizing.py tests/test_record.py \
        tests/test_shutdown.py tests/test_lifetime.py tests/test_index_queue.py
    step timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/test_delivery.py
    step timeout 90 env PYTHONPATH="$PWD" python3 benchmarks/install_threads.py --workers 15 \
        --batches 150 --case tokens --case token_windows --case images_f32 --case recsys \
        --path install_device --path zero_copy_cuda --path install --path torch_floor \
        --json "$OUT/engine_cpu.json"
fi
if [ "$what" = trainers ]; then
    # Lightning's Trainer on resnet18 (float32 images, 15 workers) through stock,
    # install(), install(device="cuda"), Loader(device) and the GPU-resident upper
    # bound; then HF's Trainer (GPT-2 from a config, 8 workers) through stock,
    # install() and install(device="cuda"). About 8 minutes.
    step timeout 330 env PYTHONPATH="$PWD" python3 benchmarks/lightning_install.py --dtype float32 --workers 15 \
        --steps 40 --warmup 8 --timeout 80 --json "$OUT/lightning.json"
    step timeout 200 env PYTHONPATH="$PWD" python3 benchmarks/hf_install.py --workers 8 --steps 40 --warmup 8 \
        --timeout 80 --json "$OUT/hf.json"
fi
if [ "$what" = spy ]; then
    # Where install(device)'s main-process CPU per batch goes: py-spy (a static
    # binary: copy it to .tools/py-spy here and name .tools in the call's carry)
    # over benchmarks/install_threads.py, one case a run (default images_f32
    # tokens), every thread, idle excluded; then scripts/spy_top.py on the
    # stacks of the timed loop and on every stack.
    for case in ${@:-images_f32 tokens}; do
        step timeout 150 .tools/py-spy record -r 2000 --threads -f raw -o "$OUT/spy_$case.txt" -- \
            env PYTHONPATH="$PWD" python3 benchmarks/install_threads.py --workers 15 \
            --batches 600 --case "$case" --path install_device
        step timeout 30 python3 scripts/spy_top.py "$OUT/spy_$case.txt" --within "run (install_threads.py"
        step timeout 30 python3 scripts/spy_top.py "$OUT/spy_$case.txt" --top 25
    done
fi
if [ "$what" = parts ]; then
    cases=""
    for case in ${@:-tokens images_f32 recsys}; do cases="$cases --case $case"; done
    step timeout 300 env PYTHONPATH="$PWD" python3 benchmarks/delivery_parts.py --workers 15 \
        --batches 300 $cases --json "$OUT/parts.json"
fi
if [ "$what" = percall ]; then
    # Most wanted first: a call cut short by the device's time still brings
    # back what ran (the log is written as it goes).
    step timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
        tests/test_pin_default.py tests/test_index_queue.py tests/test_gpu.py \
        tests/test_install.py::test_end_with_the_result_queue_lock_lost \
        tests/test_install.py::test_break_leaks_nothing tests/test_install.py::test_killed_worker_leaks_nothing
    step timeout 80 env PYTHONPATH="$PWD" python3 benchmarks/pin_parts.py --calls 1500 \
        --sizes 262144 1048576 4194304
    step timeout 60 bash -c "gcc -O2 -I${CUDA_HOME:-/usr/local/cuda}/include -o /tmp/driver_calls \
        benchmarks/driver_calls.c -ldl && /tmp/driver_calls"
    step timeout 170 env PYTHONPATH="$PWD" python3 benchmarks/pin_cutover.py --recommend \
        --settings default --max-seconds 100 --json "$OUT/pin_cutover.json"
    step timeout 70 env PYTHONPATH="$PWD" python3 benchmarks/install_threads.py --workers 15 \
        --batches 300 --case tokens --case recsys --path install_device --path zero_copy_cuda \
        --path install --path torch_floor --json "$OUT/engine_cpu.json"
    step timeout 130 python3 -m fastpin.bench --case tokens --case token_windows --case recsys \
        --workers 15 --path pin_memory --path prefetcher --path install --path install_device \
        --path zero_copy --no-progress --json "$OUT/bench_small.json"
fi
if [ "$what" = omp ]; then
    # The torch span copied by torch's OpenMP team directly (the default)
    # against through its copy_: the span's tests on the GPU, the pin table
    # (default, copy_, the span from 128 KiB; 128 KiB to 16 MiB, hot and cold), and
    # install() with num_workers=0 on tokens, the default and then copy_.
    # `omp short` (about 3 minutes): default against copy_ alone, to 8 MiB,
    # two rounds of tokens each.
    sizes="128K 256K 1M 2M 4M 8M 16M" settings="default copy_ span_128k" budget=170 rounds=3
    [ "${1:-}" = short ] && sizes="256K 1M 2M 4M 8M" settings="default copy_" budget=110 rounds=2
    step timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
        tests/test_pin_default.py tests/test_gpu.py tests/test_pin_memory.py -k "torch_copy or team or default or gpu"
    step timeout $((budget + 80)) env PYTHONPATH="$PWD" python3 benchmarks/pin_cutover.py \
        --recommend --sizes $sizes --settings $settings --max-seconds $budget \
        --json "$OUT/omp_cutover.json"
    for knobs in "" team_grain=0; do
        step timeout $((rounds * 30 + 20)) env FASTPIN_COPY="$knobs" python3 -m fastpin.bench \
            --case tokens --workers 0 --rounds $rounds --path pin_memory --path install \
            --no-progress --json "$OUT/omp_tokens${knobs:+_copy_}.json"
    done
fi
if [ "$what" = team ]; then
    # The copy by a spinning team against torch's OpenMP team, memcpy against
    # an AVX2 loop (no fastpin); with DIR (a tree holding csrc/, fastpin/ and
    # setup.py, a pool under trial) the pin table of that build, torch's copy_
    # (default) against the pool spinning in slices from 16 KiB; DIR's
    # environment settings after it (NAME=VALUE ...) apply to that run.
    step timeout 60 bash -c "gcc -O2 -fopenmp -pthread -o /tmp/team_copy benchmarks/team_copy.c \
        && /tmp/team_copy $(nproc) 300 | tee $OUT/team_copy.txt"
    if [ $# -gt 0 ]; then
        dir=$(realpath "$1"); shift
        step timeout 150 bash -c "cd $dir && python3 setup.py -q build_ext --inplace"
        step timeout 200 env "$@" PYTHONPATH="$dir" python3 benchmarks/pin_cutover.py --recommend \
            --sizes 256K 1M 2M 4M 8M 16M --settings default pool_spin_16k --max-seconds 150 \
            --json "$OUT/team_cutover.json"
    fi
fi
if [ "$what" = profile ]; then
    step env PYTHONPATH="$PWD" python3 benchmarks/profile_zero_copy.py "$@"
fi
exit $status
