#!/usr/bin/env bash
# One step of the GPU evidence per call, each inside the device tool's 10-minute command limit
# (nvidia-h200-x2; carry python/zbuf/_core.abi3.so). Writes logs and records to $OUT.
#   bash benches/device/run.sh tests      # every tests/gpu test, four files at a time
#   bash benches/device/run.sh tests tests/gpu/test_compile_gpu.py ...  # only the files named
#   bash benches/device/run.sh pool       # pool GPU tests, pool and op-dispatch benchmarks (~2 min)
#   bash benches/device/run.sh 17b        # qwen3-1.7b: zbuf, ddp, fsdp2    (~6.5 min)
#   bash benches/device/run.sh 8b         # qwen3-8b: zbuf, fsdp2           (~6 min)
#   bash benches/device/run.sh 8b-cap     # qwen3-8b --mem-frac 0.68        (~5 min)
#   bash benches/device/run.sh 14b zbuf   # qwen3-14b on nvidia-h200-x8, one engine per call;
#                                           14b-cap: --mem-frac 0.57 (issue 8)
#   bash benches/device/run.sh 14b-x2     # qwen3-14b shape, 8 layers, on x2; 14b-x2-cap capped
#   bash benches/device/run.sh 1gpu-memfloor [FRACS]  # ONE H200 (nvidia-h200): qwen3-1.7b, 1 rank,
#                                           zbuf vs fsdp2, adamw, --mem-frac 0.30,0.25,0.20 by default,
#                                           each engine until its first failure (~8 min)
#   bash benches/device/run.sh floor17b ENGINE OPTIMIZER FRACS  # ONE H200, issue 20's floors:
#                                           qwen3-1.7b 1 rank (floor8b-sim: qwen3-8b as rank 0
#                                           of 2), from 0.45 (0.70) down by 0.05, two per call
#   bash benches/device/run.sh floor8b-pair OPTIMIZER ZBUF_FRACS FSDP2_FRACS [ZBUF ARGS]  # ONE H200:
#                                           floor8b-sim's zbuf and FSDP2 series side by side (caps
#                                           summing <= 0.95; step times not comparable)
#   bash benches/device/run.sh memfloor-8b ENGINE OPTIMIZER FRACS  # nvidia-h200-x2, issue 12's
#                                           table: qwen3-8b, one engine, adamw|adamw-fused, about
#                                           two fractions per call (e.g. 0.60,0.55), stopping at
#                                           the first failure; run it down from 0.70 by 0.05 per
#                                           engine and optimizer, then summarise all calls with
#                                           python3 benches/memfloor.py --summarize DIR... --out
#                                           benches/results/memfloor_qwen3-8b
#   bash benches/device/run.sh 1gpu-compile  # nvidia-h200 (one GPU), issue 14: qwen3-1.7b first
#                                           step cold and warm, whole graph vs block frames (~7 min)
# Issue 13 (budgeted recompute; ENGINE:MODE runs one engine with its own --ac mode):
#   bash benches/device/run.sh 1gpu-ac    # nvidia-h200, qwen3-1.7b, 1 rank: zbuf:auto, zbuf:full,
#                                           fsdp2:full, fsdp2:selective              (~7 min)
#   bash benches/device/run.sh 1gpu-plain # nvidia-h200, 4 qwen3-8b layers, 1 rank: the plain user
#                                           setup vs zbuf bench's engine, one factor at a time
#                                           (benches/plain_setup.py)                  (~6 min)
#   bash benches/device/run.sh 8b-ac SPEC     # nvidia-h200-x2, qwen3-8b, one SPEC per call, of
#                                               zbuf:auto zbuf:full fsdp2:full fsdp2:selective
#   bash benches/device/run.sh 8b-ac-cap SPEC # the same at --mem-frac 0.68
#   bash benches/device/run.sh 17b-ac         # nvidia-h200-x2, qwen3-1.7b: zbuf:auto, fsdp2:full,
#                                               ddp:full; 17b-ac-more: zbuf:full, fsdp2:selective
#   then: zbuf bench --merge $OUT/8bac_*.json --out benches/results/train_step_qwen3-8b_ac.json
# Issue 19 (one GPU stands for N: --simulate-world, [Note: simulated ranks]), all on ONE H200
# (nvidia-h200), one engine per call:
#   bash benches/device/run.sh seed14 ENGINE[:MODE] [ARGS]  # the reference configuration: qwen3-14b as
#                                           rank 0 of 8 on an 80 GiB card, mb 4, seq 4096, AC,
#                                           10 + 20 steps; ENGINE: zbuf, zbuf:auto, fsdp2 (measured
#                                           at d22971a on a warm machine: zbuf 3.8 min, zbuf:auto
#                                           7.8 min, fsdp2 2.3 min; a fresh machine adds ~2 min);
#                                           ARGS go to zbuf bench (e.g. --compile-structure blocks)
#                                           then: zbuf bench --merge $OUT/seed14_*.json --out
#                                           benches/results/seed14.json; python3
#                                           benches/reference_table.py benches/results/seed14.json
#   bash benches/device/run.sh seed14-twice ENGINE[:MODE] [ARGS]  # the same launched twice with the
#                                           same caches: cold (10 + 20 steps) and warm (4 + 4)
#                                           first steps
#   bash benches/device/run.sh 17b-blocks # qwen3-1.7b, 1 rank, blocks: zbuf full/auto vs FSDP2 cold,
#                                           then zbuf warm (issue 21's 1.7b rows, ~5 min)
#   bash benches/device/run.sh profile14  # qwen3-14b's layer shape, 4 layers: profiled steps of zbuf
#                                           blocks, FSDP2 and zbuf graph (issue 21's step gap, ~4 min)
#   bash benches/device/run.sh 8b-sim ENGINE [ARGS] # qwen3-8b as rank 0 of 2 (whole card) (~5 min)
#   bash benches/device/run.sh fit8b [ENGINE] [MIN] [MAX]  # zbuf fit qwen3-8b, world 8, 80 GiB
#                                           card, seq 4096, AC; doubling from MIN (default 4) to
#                                           MAX (default 16); a call holds 2-3 probes (each
#                                           compiles), so narrow MIN..MAX by what the last call
#                                           found; commit the JSONs under benches/results/
#   bash benches/device/run.sh plain14 [VARIANTS] [AC]  # benches/plain_setup.py as rank 0 of 8,
#                                           qwen3-14b, 80 GiB card: the plain user setup vs the
#                                           bench engine, AC full (default) or auto; one variant
#                                           per call (bench+eager-loss full: 3.6 min at d22971a)
#   bash benches/device/run.sh plain8b [VARIANTS] [AC]  # the same, qwen3-8b as rank 0 of 2, whole card
#   bash benches/device/run.sh onepath 14b|17b|32b PLACEMENT [VARIANTS]  # issue 36: the plain
#                                           setup, FSDP2 (expandable segments) beside
#                                           zbuf.compile(model, optimizer=opt), cold caches
# Issue 38 (qwen3-32b; the optimizer's state offloaded around the step after backward; zbuf fit
# checked), all on ONE H200 (nvidia-h200), as rank 0 of 8 on an 80 GiB card, mb 4, seq 4096, AC:
#   bash benches/device/run.sh 32b ENGINE [ARGS]  # zbuf bench, qwen3-32b, 10 + 20 steps, one engine
#                                           per call: fsdp2 (expandable segments, per-block compile;
#                                           expected to run out of memory within a minute or two)
#                                           or zbuf (--compile-structure blocks; the plan offloads
#                                           what does not fit by itself: ~5-6 min estimated)
#                                           then: zbuf bench --merge $OUT/32b_*.json --out
#                                           benches/results/bench32b.json
#   bash benches/device/run.sh onepath 32b inside fsdp2|zbuf.compile  # the plain user setup, one
#                                           variant per call (~5-6 min for zbuf.compile)
#   bash benches/device/run.sh offload14 [ARGS]  # qwen3-14b, zbuf blocks, the same call twice: the
#                                           state on the device, then all of it in host memory
#                                           (--offload-optimizer); with --steps 16 --warmup 6
#                                           both ran in 204 s (2026-12-05); two records (they
#                                           differ in offload_optimizer, so they do not merge).
#                                           The window ([Note: the step's window]) is sized at
#                                           step 4 from step 3's profile: keep --warmup >= 5 so
#                                           the measured steps all run in it; the summary's
#                                           "offload window" row says what it held
#   bash benches/device/run.sh fit32b [ENGINE] [MIN] [MAX]  # zbuf fit qwen3-32b (blocks), doubling
#                                           from MIN (default 1) to MAX (default 8); fit8b as above
#   bash benches/device/run.sh fitcheck 8b|32b MB  # zbuf fit's answer checked: zbuf bench at
#                                           micro-batch MB with fit's settings, 10 + 20 steps
#                                           (~5-6 min); run it at the answer (expect ok, 0 retries
#                                           after step 2) and at the answer + 1 (expect out of
#                                           memory, retries, or the plan's refusal)
#   bash benches/device/run.sh lockprobe   # ONE GPU: does locking the offloaded blocks' arenas slow
#                                           the compile's tracing or its driver calls
#                                           (benches/lock_contention.py, ~1-2 min)
# BENCH_TIMEOUT=S bounds one bench/plain14 run (default 580 s) when a call chains two
# Merge afterwards here: zbuf bench --merge A.json B.json --out benches/results/...json
# Sequences longer than one call: start them detached (`setsid nohup bash -c '...' &`) writing
# under /tmp, and follow with calls that wait and copy the logs to $OUT. The machine is given
# back 30 s after a call ends, killing detached work with it: chain the next call at once (a gap
# of two minutes lost a running `fit8b` on 2026-12-02).
set -uo pipefail
cd "$(dirname "$0")/../.."
# The Rust extension travels only when the call carries it (a fresh checkout has none built: on
# 2026-12-06 a call without it measured nothing in 34 s of device time).
if ! ls python/zbuf/_core*.so >/dev/null 2>&1; then
  echo "run.sh: python/zbuf/_core.abi3.so is missing: build it first (pip install -e .) and" \
    "pass carry=[\"python/zbuf/_core.abi3.so\"]" >&2
  exit 2
fi
source benches/device/env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
COMMON=(--micro-batch 4 --seq-len 4096 --ac --steps 30 --warmup 10 --no-progress)
# The "80 GiB card" the references name: 80 GiB of an H200, or the whole of an 80 GB H100 (79.18
# GiB as torch sees it; the card DeepCompile's reference ran on): no fraction of an H100 holds 80.
CARD80=$(python3 -c "import torch; t = torch.cuda.get_device_properties(0).total_memory >> 20; print('80GiB' if t >= 80 << 10 else f'{t}MiB')")
echo "80 GiB card: --gpu-memory $CARD80"

summaries() {  # the per-rank profile summaries of one step, as one file
  python3 - "$1" <<'EOF'
import glob, json, os, sys
out = {os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob('/tmp/prof/*.summary.json'))}
json.dump(out, open(os.path.join(os.environ['OUT'], sys.argv[1]), 'w'), indent=1)
for k, v in out.items():
    print(k, {x: round(v[x], 1) for x in v if x.endswith('per_step') and isinstance(v[x], float)})
EOF
}

bench() {  # bench NAME ENGINE[:MODE] [extra args...]: one engine, its own record
  local name=$1 engine=$2
  shift 2
  timeout "${BENCH_TIMEOUT:-580}" python3 -m zbuf.cli bench --engines "$engine" "${COMMON[@]}" "$@" \
    --out "$OUT/${name}_${engine/:/-}.json" 2>&1 | grep -v "Warning\|warn" | tee "$OUT/${name}_${engine/:/-}.log" | tail -20
}

# Every tests/gpu test in one call (serially they took 359 + 359 + 173 s at 901b1fe..e75dcd8, three
# calls): the files that read the whole device's free memory or fill it run alone, after the rest
# ran four files at a time (pytest-xdist, one file a worker: module fixtures stay whole; each
# process counts its own peaks, and the small models leave the card mostly free for the others).
# Each test's line is logged as it ends (-v), so a call cut off by the limit still says which
# tests passed. `tests FILE...` runs only the files named, one after another.
DEVICE_WIDE_GPU_TESTS=(tests/gpu/test_memory_gpu.py tests/gpu/test_pool_gpu.py
  tests/gpu/test_torch_allocator_gpu.py)
case "${1:-}" in
  tests)
    shift
    log="$OUT/gpu_tests.log"
    if [ $# -eq 0 ]; then
      ZBUF_POISON_RELEASES=1 timeout 430 python3 -m pytest -v -ra -p no:cacheprovider -n 4 \
        --dist loadfile $(ls tests/gpu/test_*.py | grep -v -F "$(printf '%s\n' \
        "${DEVICE_WIDE_GPU_TESTS[@]}")") --timeout 400 --durations=15 > "$log" 2>&1
      set -- "${DEVICE_WIDE_GPU_TESTS[@]}"
    fi
    ZBUF_POISON_RELEASES=1 timeout 150 python3 -m pytest -v -ra -p no:cacheprovider "$@" \
      --timeout 120 --durations=15 >> "$log" 2>&1
    grep -E "passed|failed|error|PASSED|FAILED|ERROR|SKIPPED" "$log" | tail -80 ;;
  pool)
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pool_gpu.py 2>&1 | tail -5
    timeout 120 python3 benches/pool_bench.py --device cuda --out "$OUT" 2>&1 | tail -20
    timeout 120 python3 benches/op_dispatch_bench.py --device all --out "$OUT" 2>&1 | tail -20 ;;
  17b)
    timeout 590 python3 -m zbuf.cli bench --engines zbuf,ddp,fsdp2 --preset qwen3-1.7b "${COMMON[@]}" \
      --profile-dir /tmp/prof --out "$OUT/train_step_qwen3-1.7b.json" 2>&1 | grep -v "Warning\|warn" | tail -40
    summaries profile_qwen3-1.7b.json ;;
  8b)
    for e in zbuf fsdp2; do bench 8b "$e" --preset qwen3-8b --profile-dir /tmp/prof; done
    summaries profile_qwen3-8b.json ;;
  8b-cap)
    for e in zbuf fsdp2; do bench 8bcap "$e" --preset qwen3-8b --mem-frac 0.68; done ;;
  14b|14b-cap)  # nvidia-h200-x8, issue 8's reference run: the engines named after it, or all
    cap=(); [ "$1" = 14b-cap ] && cap=(--mem-frac 0.57)
    engines=("${@:2}"); [ ${#engines[@]} -eq 0 ] && engines=(zbuf fsdp2 zbuf-eager)
    for e in "${engines[@]}"; do bench "$1" "$e" --preset qwen3-14b "${cap[@]}"; done ;;
  14b-x2|14b-x2-cap)  # nvidia-h200-x2: qwen3-14b's layer shape, 8 of its 40 layers (about the
    # per-rank state of the whole model on 8 GPUs), when the x8 kind is not lent
    cap=(); [ "$1" = 14b-x2-cap ] && cap=(--mem-frac 0.57)
    for e in zbuf fsdp2 zbuf-eager; do bench "$1" "$e" --preset qwen3-14b --layers 8 "${cap[@]}"; done ;;
  1gpu-memfloor)  # one H200: where each engine stops completing steps as the card shrinks
    timeout 560 python3 benches/memfloor.py --engines zbuf,fsdp2 --optimizer adamw \
      --fracs "${2:-0.30,0.25,0.20}" --out-dir "$OUT" --time-limit 540 -- \
      --preset qwen3-1.7b --micro-batch 4 --seq-len 4096 --ac --steps 12 --warmup 4 2>&1 | tail -20 ;;
  floor17b|floor8b-sim)  # ONE H200, issue 20's floors: floor17b ENGINE OPTIMIZER FRACS [BENCH
    # ARGS] (qwen3-1.7b, 1 rank) or floor8b-sim ... (qwen3-8b as rank 0 of 2), about two
    # fractions per call, stopping at the first failure; summarise with memfloor.py --summarize.
    # BENCH ARGS go to every run, e.g. --optimizer-in-backward (engine zbuf)
    [ $# -ge 4 ] || { echo "usage: $0 $1 zbuf|fsdp2 adamw|adamw-fused 0.30,0.25 [bench args]" >&2; exit 2; }
    model=(--preset qwen3-1.7b); [ "$1" = floor8b-sim ] && model=(--preset qwen3-8b --simulate-world 2)
    dir="$OUT/$1"; [ $# -gt 4 ] && dir="$dir$(echo "${@:5}" | tr -cs 'a-z0-9' '_')"; mkdir -p "$dir"
    timeout 590 python3 benches/memfloor.py --engines "$2" --optimizer "$3" --fracs "$4" \
      --out-dir "$dir" --time-limit 575 -- \
      "${model[@]}" --micro-batch 4 --seq-len 4096 --ac --steps 12 --warmup 4 "${@:5}" 2>&1 | tail -20 ;;
  floor8b-pair)  # ONE H200: floor8b-pair OPTIMIZER ZBUF_FRACS FSDP2_FRACS [ZBUF ARGS]: the zbuf
    # and FSDP2 floor8b-sim series side by side on the one card, to halve the device time. Each
    # process is capped by its own --mem-frac; keep each pair's sum <= 0.95 so neither can meet
    # the other's memory (the caps, not the card, bound them). Floors and retries are each
    # process's own; step times are NOT comparable (two processes share the SMs).
    [ $# -ge 4 ] || { echo "usage: $0 $1 adamw|adamw-fused 0.30,0.25 0.65,0.60 [zbuf args]" >&2; exit 2; }
    model=(--preset qwen3-8b --simulate-world 2 --micro-batch 4 --seq-len 4096 --ac --steps 12 --warmup 4)
    dir="$OUT/floor8b-pair_$2"; mkdir -p "$dir/zbuf" "$dir/fsdp2"
    timeout 590 python3 benches/memfloor.py --engines fsdp2 --optimizer "$2" --fracs "$4" \
      --out-dir "$dir/fsdp2" --time-limit 575 -- "${model[@]}" > "$dir/fsdp2.log" 2>&1 &
    timeout 590 python3 benches/memfloor.py --engines zbuf --optimizer "$2" --fracs "$3" \
      --out-dir "$dir/zbuf" --time-limit 575 -- "${model[@]}" "${@:5}" > "$dir/zbuf.log" 2>&1
    wait
    tail -n 12 "$dir/fsdp2.log" "$dir/zbuf.log" ;;
  memfloor-8b)  # nvidia-h200-x2: memfloor-8b ENGINE OPTIMIZER FRAC[,FRAC...]
    [ $# -eq 4 ] || { echo "usage: $0 memfloor-8b zbuf|fsdp2 adamw|adamw-fused 0.60,0.55" >&2; exit 2; }
    timeout 590 python3 benches/memfloor.py --engines "$2" --optimizer "$3" --fracs "$4" \
      --out-dir "$OUT" --time-limit 575 -- \
      --preset qwen3-8b --micro-batch 4 --seq-len 4096 --ac --steps 20 --warmup 5 2>&1 | tail -20 ;;
  1gpu-compile)  # issue 14: cold then warm caches, the whole graph and the block frames
    runs=()
    for mode in graph blocks; do
      flag="--compile-structure $mode"
      export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache-$mode
      rm -rf "$TORCHINDUCTOR_CACHE_DIR"
      for cache in cold warm; do
        name=compile_1gpu_${mode}_${cache}
        limit=180; [ "$cache" = warm ] && limit=80  # 4 runs within the 9-minute budget
        timeout $limit python3 -m zbuf.cli train --nproc 1 --preset qwen3-1.7b --micro-batch 4 \
          --seq-len 4096 --ac --steps 12 --warmup 4 --no-progress $flag --out "$OUT/$name.json" \
          2>&1 | grep -v "Warning\|warn" > "$OUT/$name.log"
        grep "first step\|step time, median\|peak device" "$OUT/$name.log"
        runs+=("$mode, $cache=$OUT/$name.json")
      done
    done
    unset TORCHINDUCTOR_CACHE_DIR
    python3 benches/compile_phases.py --out "$OUT/compile_phases_1gpu" "${runs[@]}" ;;
  1gpu-ac)  # nvidia-h200: the recompute modes and FSDP2's full and selective AC on one rank
    timeout 560 python3 -m zbuf.cli bench --engines zbuf:auto,zbuf:full,fsdp2:full,fsdp2:selective \
      --preset qwen3-1.7b --nproc 1 --micro-batch 4 --seq-len 4096 --steps 20 --warmup 8 \
      --no-progress --out "$OUT/train_step_qwen3-1.7b_1gpu_ac.json" 2>&1 | grep -v "Warning\|warn" | tail -60 ;;
  1gpu-plain)  # nvidia-h200: where a plain user setup and zbuf bench's engine differ
    timeout 560 python3 benches/plain_setup.py --preset qwen3-8b --layers 4 --micro-batch 4 \
      --seq-len 4096 --ac full --steps 20 --warmup 8 --out "$OUT" 2>&1 | grep -v "Warning\|warn" | tail -30 ;;
  8b-ac|8b-ac-cap)  # nvidia-h200-x2, one ENGINE:MODE per call (issue 13's must-show table)
    cap=(); [ "$1" = 8b-ac-cap ] && cap=(--mem-frac 0.68)
    bench "${1/-/}" "${2:?give one of zbuf:auto zbuf:full fsdp2:full fsdp2:selective}" \
      --preset qwen3-8b "${cap[@]}" ;;
  17b-ac|17b-ac-more)  # nvidia-h200-x2: qwen3-1.7b, the recompute modes against FSDP2 and DDP
    specs=(zbuf:auto fsdp2:full ddp:full); [ "$1" = 17b-ac-more ] && specs=(zbuf:full fsdp2:selective)
    for e in "${specs[@]}"; do bench 17bac "$e" --preset qwen3-1.7b --steps 25; done ;;
  seed14)  # ONE H200: issue 19's reference configuration, one engine per call
    bench "seed14${3:+_$(echo "${@:3}" | tr -cs 'a-z0-9' '_')}" "${2:?give one of zbuf zbuf:auto fsdp2}" \
      --preset qwen3-14b --simulate-world 8 --gpu-memory $CARD80 "${@:3}" ;;
  seed14-twice)  # ONE H200: seed14-twice ENGINE[:MODE] [ARGS]: the reference configuration
    # launched twice with the same caches (issue 21's warm start): records *_cold and *_warm;
    # the first launch is cold only on a fresh machine (or after another tree's compile)
    # the cold launch measures the step (10 + 20 steps), the warm one only its first step (4 + 4)
    name="seed14${3:+_$(echo "${@:3}" | tr -cs 'a-z0-9' '_')}"
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-330} bench "${name}_cold" "${2:?give one of zbuf zbuf:auto fsdp2}" \
      --preset qwen3-14b --simulate-world 8 --gpu-memory $CARD80 "${@:3}"
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} bench "${name}_warm" "$2" \
      --preset qwen3-14b --simulate-world 8 --gpu-memory $CARD80 --steps 8 --warmup 4 "${@:3}" ;;
  17b-blocks)  # ONE H200: issue 21 at qwen3-1.7b, 1 rank, under --compile-structure blocks: zbuf
    # full and auto beside FSDP2 full AC, caches cold (10 + 20 steps), then zbuf's warm relaunch
    # (4 + 4): records 17b_blocks_cold.json and 17b_blocks_warm.json
    for launch in cold warm; do
      steps=(); engines=zbuf:full,zbuf:auto,fsdp2:full
      [ "$launch" = warm ] && { steps=(--steps 8 --warmup 4); engines=zbuf:full,zbuf:auto; }
      timeout "${BENCH_TIMEOUT:-280}" python3 -m zbuf.cli bench --engines "$engines" "${COMMON[@]}" \
        --preset qwen3-1.7b --nproc 1 --compile-structure blocks "${steps[@]}" \
        --out "$OUT/17b_blocks_$launch.json" 2>&1 | grep -v "Warning\|warn" \
        | tee "$OUT/17b_blocks_$launch.log" | tail -16
    done ;;
  profile14)  # ONE H200: where the step goes under each compile structure: qwen3-14b's layer
    # shape, 4 layers, rank 0 of 8, AC full, 2 profiled steps per engine (torch.profiler traces and
    # the top kernels per step): zbuf blocks and FSDP2 in one bench, zbuf graph in another
    for run in "blocks zbuf,fsdp2" "graph zbuf"; do
      set -- $run
      timeout "${BENCH_TIMEOUT:-200}" python3 -m zbuf.cli bench --engines "$2" "${COMMON[@]}" \
        --preset qwen3-14b --layers 4 --simulate-world 8 --gpu-memory $CARD80 --steps 10 --warmup 4 \
        --compile-structure "$1" --profile-dir "$OUT/profile14_$1" --out "$OUT/profile14_$1.json" \
        2>&1 | grep -v "Warning\|warn" | tail -22
    done ;;
  8b-sim)  # ONE H200: qwen3-8b as rank 0 of 2
    bench 8bsim "${2:?give one of zbuf fsdp2}" --preset qwen3-8b --simulate-world 2 "${@:3}" ;;
  fit8b)  # ONE H200: zbuf fit qwen3-8b, world 8, 80 GiB card
    timeout 590 python3 -m zbuf.cli fit --engine "${2:-zbuf}" --preset qwen3-8b --simulate-world 8 \
      --gpu-memory $CARD80 --seq-len 4096 --ac --steps 6 --warmup 3 --min-micro-batch "${3:-4}" \
      --max-micro-batch "${4:-16}" --probe-timeout 280 --out "$OUT/fit8b_${2:-zbuf}_${3:-4}-${4:-16}.json" \
      2>&1 | grep -v "Warning\|warn" | tee "$OUT/fit8b_${2:-zbuf}.log" | tail -20 ;;
  onepath)  # ONE H200, issue 36: onepath MODEL PLACEMENTS [VARIANTS]: the plain user setup
    # (benches/plain_setup.py, the user's checkpoint PLACEMENTS, comma-separated, of inside,
    # parent, wrapper, selective, none; at 17b a placement's two engines take about 130 s;
    # PLAIN_ARGS go to plain_setup.py, e.g. "--attn-dropout 0.1"), each variant a
    # process of its own with an empty Inductor cache (cold first steps): FSDP2 with expandable
    # segments (its best), then zbuf.compile(model, optimizer=opt), then any other VARIANTS
    # (default fsdp2,zbuf.compile; plain = torch.compile(backend="zbuf"); zbuf.compile+auto =
    # recompute="auto", its blocks kept, offloaded or recomputed). MODEL: 14b (qwen3-14b
    # as rank 0 of 8 on an 80 GiB card, ~6 min for the two) or 17b (qwen3-1.7b, one real rank).
    # Records: onepath_MODEL_PLACEMENT_VARIANT/plain_setup.json in $OUT/onepath_MODEL_records.tgz;
    # PROFILE=1: two extra steps profiled per variant, the summary under .../profile/ and printed.
    # TRACE_STEP=N: step N's allocation history read for the requests torch's allocator retried
    # at (benches/allocator_retries.py), in the record and printed; the history itself kept in
    # the records (allocation_history_VARIANT_stepN.json.gz: read it again on any machine with
    # python3 benches/allocator_retries.py FILE).
    # zbuf.compile runs with PYTORCH_CUDA_ALLOC_CONF blank: torch's allocator left to zbuf
    limit=290
    # The first process on a fresh machine reads torch's, Triton's and CUDA's libraries from
    # disk: a throwaway compile first, so that the variant that runs first (FSDP2) is not
    # charged for it (on 2026-12-06 FSDP2's first step at 14B took 16.0 and 18.8 s in the calls
    # that started a fresh machine, 13.1 and 18.1 s in the calls after them: not conclusive, but
    # the order of the calls should not decide it).
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_warm python3 -c "import torch; torch.compile(lambda x: (x * 2).sin())(torch.ones(8, device='cuda'))" >/dev/null 2>&1 || true
    rm -rf /tmp/inductor_warm
    # OWN_CARD=1: no --gpu-memory, the card's own limit (a card of 80 GiB or less: the emulation
    # splits the card by the pool's budget, stricter than the card itself; onepath32b.md)
    card=(--gpu-memory $CARD80); [ -z "${OWN_CARD:-}" ] || card=()
    case "${2:?give 14b, 17b or 32b}" in
      14b) model=(--preset qwen3-14b --simulate-world 8 "${card[@]}") ;;
      17b) model=(--preset qwen3-1.7b) ;;
      32b) model=(--preset qwen3-32b --simulate-world 8 "${card[@]}"); limit=580 ;;  # one variant a call
    esac
    for placement in $(echo "${3:?give inside, parent, wrapper, selective or none}" | tr , ' '); do
     for v in $(echo "${4:-fsdp2,zbuf.compile}" | tr , ' '); do
      alloc=; [ "$v" = fsdp2 ] && alloc=expandable_segments:True
      name=onepath_$2_${placement}_${v//+/-}  # the device tool brings back no file named with a '+'
      rm -rf "/tmp/inductor_$v"
      PYTORCH_CUDA_ALLOC_CONF=$alloc TORCHINDUCTOR_CACHE_DIR="/tmp/inductor_$v" \
        timeout "${BENCH_TIMEOUT:-$limit}" python3 benches/plain_setup.py "${model[@]}" --micro-batch 4 \
        --seq-len 4096 --ac full --placement "$placement" --steps 30 --warmup 10 \
        --variants "$v" --out "$OUT/$name" ${PLAIN_ARGS:-} \
        ${PROFILE:+--profile-dir "$OUT/$name/profile"} ${TRACE_STEP:+--trace-step $TRACE_STEP} \
        2>&1 | grep -v "Warning\|warn" \
        | tee "$OUT/$name.log" | tail -3
      python3 -c "import json,sys; [print({k: r.get(k) for k in ('variant', 'status', 'step_ms_median', 'first_step_s', 'time_to_final_plan_s', 'compiled_steps', 'replanned_steps', 'warmup_step_s', 'peak_device_bytes', 'peak_reserved_bytes', 'alloc_retries_by_step', 'allocator_trace')}, 'last loss', (r.get('losses') or [None])[-1], 'offload', (r.get('planned') or {}).get('activation_offload'), 'block forward ms', (r.get('planned') or {}).get('measured_block_forward_ms'), 'phases', {k: {p: round(v, 1) for p, v in ph['phases'].items()} for k, ph in (r.get('compile_phases_by_step') or {}).items()}, 'timers of step 1', {t: round(v, 2) for t, v in list(((r.get('compile_phases_by_step') or {}).get('1') or {}).get('timers', {}).items())[:12]}) for r in json.load(open(sys.argv[1]))['variants']]" "$OUT/$name/plain_setup.json" || true
      [ -z "${PROFILE:-}" ] || python3 -c "import json,glob; [print(p, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in json.load(open(p)).items() if not k.startswith('top_')}, json.load(open(p)).get('top_kernels_ms_per_step', [])[:8], *[(round(k['ms'], 2), k['calls'], k['kernel']) for k in json.load(open(p)).get('top_named_kernels_ms_per_step', [])[:24]], sep='\\n') for p in glob.glob('$OUT/$name/profile/*.summary.json')]"
     done
    done
    # The device tool brings 8 files back a call (three placements' records did not come back):
    # the records travel as one archive, beside the logs.
    (cd "$OUT" && tar czf "/tmp/onepath_$2_records.tgz" onepath_$2_*/ && rm -rf onepath_$2_*/ \
      && mv "/tmp/onepath_$2_records.tgz" .) ;;
  32b)  # ONE H200, issue 38: 32b ENGINE [ARGS]: qwen3-32b as rank 0 of 8 on an 80 GiB card
    engine=${2:?give fsdp2 or zbuf}
    structure=(); [ "$engine" = zbuf ] && structure=(--compile-structure blocks)
    alloc=; [ "$engine" = fsdp2 ] && alloc=expandable_segments:True  # FSDP2's best ([DEVICE.md])
    PYTORCH_CUDA_ALLOC_CONF=$alloc bench "32b${3:+_$(echo "${@:3}" | tr -cs 'a-z0-9' '_')}" \
      "$engine" --preset qwen3-32b --simulate-world 8 --gpu-memory $CARD80 "${structure[@]}" "${@:3}" ;;
  offload14)  # ONE H200, issue 38: the optimizer's state on the device, then in host memory
    for where in device host; do
      flag=(); [ "$where" = host ] && flag=(--offload-optimizer)
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-290} bench "offload14_$where" zbuf --preset qwen3-14b \
        --simulate-world 8 --gpu-memory $CARD80 --compile-structure blocks "${flag[@]}" "${@:2}"
    done ;;
  lagprobe)  # ONE GPU: each step's peak with the Python thread far ahead of the device, the
    # block gathers on the gather stream and on the compute stream (benches/lag_peaks_probe.py)
    timeout 300 python3 benches/lag_peaks_probe.py "$OUT/lag_peaks.json" 2>&1 \
      | grep -v "Warning\|warn" | tail -8 ;;
  lockprobe)  # ONE GPU: the re-plan's compile beside the arenas' locking (onepath14.md)
    timeout 300 python3 benches/lock_contention.py --out "$OUT" 2>&1 | grep -v "Warning\|warn" \
      | tee "$OUT/lock_contention.log" | tail -12 ;;
  fit32b)  # ONE H200, issue 38: zbuf fit qwen3-32b, world 8, 80 GiB card, blocks
    timeout 590 python3 -m zbuf.cli fit --engine "${2:-zbuf}" --preset qwen3-32b --simulate-world 8 \
      --gpu-memory $CARD80 --seq-len 4096 --ac --steps 6 --warmup 3 --compile-structure blocks \
      --min-micro-batch "${3:-1}" --max-micro-batch "${4:-8}" --probe-timeout 280 \
      --out "$OUT/fit32b_${2:-zbuf}_${3:-1}-${4:-8}.json" 2>&1 | grep -v "Warning\|warn" \
      | tee "$OUT/fit32b_${2:-zbuf}.log" | tail -20 ;;
  fitcheck)  # ONE H200, issue 38: fitcheck 8b|32b MB: zbuf fit's answer run as zbuf bench, with
    # the settings its probes had (fit8b: the CLI's default structure; fit32b: blocks)
    case "${2:?give 8b or 32b}" in
      8b) model=(--preset qwen3-8b) ;;
      32b) model=(--preset qwen3-32b --compile-structure blocks) ;;
    esac
    bench "fitcheck_${2}_mb${3:?give the micro-batch}" zbuf "${model[@]}" --simulate-world 8 \
      --gpu-memory $CARD80 --micro-batch "$3" ;;
  plain14|plain8b)  # ONE H200: plain14 [VARIANTS] [AC]: the plain setup as rank 0 of 8 on an
    # 80 GiB card (issue 19's first table; issue 20's API paths: plain = torch.compile(backend=
    # "zbuf"), bench+eager-loss = zbuf.compile(model, optimizer=opt), each with the fp32 loss
    # outside; AC full or auto); plain8b: qwen3-8b as rank 0 of 2 on the whole card (issue 20's
    # no-cap run). One variant per call.
    ac=${3:-full}
    model=(--preset qwen3-14b --simulate-world 8 --gpu-memory $CARD80)
    [ "$1" = plain8b ] && model=(--preset qwen3-8b --simulate-world 2)
    timeout "${BENCH_TIMEOUT:-580}" python3 benches/plain_setup.py "${model[@]}" --micro-batch 4 \
      --seq-len 4096 --ac "$ac" --steps 30 --warmup 10 --variants "${2:-bench,plain}" \
      --out "$OUT/$1_$ac" 2>&1 | grep -v "Warning\|warn" | tee "$OUT/$1_$ac.log" | tail -20 ;;
  *)
    echo "usage: $0 tests [FILE...]|pool|17b|8b|8b-cap|14b [ENGINE...]|14b-cap [ENGINE...]|14b-x2|14b-x2-cap|1gpu-memfloor [FRACS]|floor17b|floor8b-sim ENGINE OPTIMIZER FRACS|floor8b-pair OPTIMIZER ZBUF_FRACS FSDP2_FRACS|memfloor-8b ENGINE OPTIMIZER FRACS|1gpu-compile|1gpu-ac|1gpu-plain|8b-ac SPEC|8b-ac-cap SPEC|17b-ac|17b-ac-more|seed14 ENGINE [ARGS]|seed14-twice ENGINE [ARGS]|17b-blocks|profile14|8b-sim ENGINE [ARGS]|fit8b [ENGINE] [MIN] [MAX]|plain14|plain8b [VARIANTS] [AC]|onepath 14b|17b|32b PLACEMENTS [VARIANTS]|32b ENGINE [ARGS]|offload14 [ARGS]|fit32b [ENGINE] [MIN] [MAX]|fitcheck 8b|32b MB" >&2
    exit 2 ;;
esac
