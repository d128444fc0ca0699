#!/usr/bin/env bash
# One GPU session's sweep, each step under its own time limit, logs and results under $OUT (at most a few files).
#   bash scripts/device_sweep.sh check      # EP=2 correctness (both transports) + the missing-peer error
#   bash scripts/device_sweep.sh bench      # Qwen3-30B-A3B EP=2 (both transports, profile) + back-to-back timing
#   bash scripts/device_sweep.sh train      # configs/tiny.toml and tiny-torch.toml on two GPUs
#   bash scripts/device_sweep.sh final      # GPU tests, fp8 (one GPU) and 30B EP=2 benchmark record
#   bash scripts/device_sweep.sh last       # half-tile configs checked on GPU, fp8 + 30B EP=2 record (after tuning)
#   bash scripts/device_sweep.sh record     # GPU tests, Qwen3-235B-A22B EP=2, tiny trainer with default autotuning
#   bash scripts/device_sweep.sh pipeline   # EP check, wgrad probe, 30B EP=2 T=16384 (profiled, back-to-back)
#   bash scripts/device_sweep.sh probe      # one-GPU check + fp8 profile (GPU 1) side by side, EP check, EP=2 T=16384
#   bash scripts/device_sweep.sh s15a       # the second ws FC1: smoke, probe, GPU tests, the layer with it (one GPU)
#   bash scripts/device_sweep.sh s15b       # ws launches through the compiled-kernel cache: tests, layer A/B, profile
#   bash scripts/device_sweep.sh s15c       # the backward's two lanes: GPU tests, the layer for several side-SM counts
#   bash scripts/device_sweep.sh s15d       # the backward's passes' configs (fp8_pass_probe.py), the fp8 layer record
#   bash scripts/device_sweep.sh s15e       # the one-pass SwiGLU backward: tests, probe, the layer against ab_base/
#   bash scripts/device_sweep.sh s15f       # the same after its copies became asynchronous (torch in the record)
#   bash scripts/device_sweep.sh s15g       # the sorting placement kernel: GPU tests, the fp8 layer (profiled)
#   bash scripts/device_sweep.sh s16a       # routing GPU test, fp8 one-call timelines, ncu on the backward's passes
#   bash scripts/device_sweep.sh s16b       # the passes' configs timed alone, the fp8 forward's host pieces
#   bash scripts/device_sweep.sh s16c       # pooled plans, new pass configs: GPU tests, the layer against ab_base/
#   bash scripts/device_sweep.sh s16d       # + no-grad bypass, kept descriptors, x quantised by the routing launch
#   bash scripts/device_sweep.sh s16e       # more one-call samples: the layer against ab_base/, three times each
#   bash scripts/device_sweep.sh s16f       # the Gluon column pass: GPU tests, pass probe, the layer against ab_base/
#   bash scripts/device_sweep.sh s16g       # the plan's expert tile ranges: GPU tests, the fp8 layer (profiled)
#   bash scripts/device_sweep.sh s19a       # the weight gradient on 256-column tiles: tests, probe, the layer A/B
#   bash scripts/device_sweep.sh s19b       # the row-tiled GEMMs on 256-column tiles: tests, probe, the layer A/B
#   bash scripts/device_sweep.sh s19c       # 256-column defaults: GPU tests, the fp8 layer record (profiled)
#   bash scripts/device_sweep.sh s19d       # compile checks with this Triton; the layer against ab_base/, both profiled
#   bash scripts/device_sweep.sh s20a       # staggered MMA partitions, two output boxes: probe; the graph probe
#   bash scripts/device_sweep.sh s20b       # the staggered config: the ws kernels' GPU tests; the graph probe
#   bash scripts/device_sweep.sh s20c       # probe once more; the layer against ab_base/, profiled
#   bash scripts/device_sweep.sh s20d       # the gathering FC2 dgrad on 256 columns: probe, the layer A/B
#   bash scripts/device_sweep.sh s20e       # the session's package: fp8 layer record, the forward in a CUDA graph
#   bash scripts/device_sweep.sh graphs     # the no-grad forward captured in a CUDA graph: replay against eager
#   bash scripts/device_sweep.sh s21a       # the persistent one-pass SwiGLU backward, no clamp: GPU tests, pass probe
#   bash scripts/device_sweep.sh s21b       # Gluon gather pass with vector loads: GPU tests, pass probe, layer A/B
#   bash scripts/device_sweep.sh s21c       # the session's package: GPU tests, layer A/B (profiled), fp8 layer record
#   bash scripts/device_sweep.sh s21d       # one-pass SwiGLU backward with an fp32 stash: tests, probe, layer with it
#   bash scripts/device_sweep.sh s21e       # the transposing passes after sharing their set-up: GPU tests, probe
#   bash scripts/device_sweep.sh s21f       # the session's final package: the fp8 layer record, the graph test
#   bash scripts/device_sweep.sh s21g       # the one-pass kernel with 16 warps: its GPU tests, the pass probe
#   bash scripts/device_sweep.sh s22a       # pipelined promotion in the ws GEMMs: GPU tests, probe
#   bash scripts/device_sweep.sh s22b       # ceiling with n256 accumulators; the layer with fp8_bwd first
#   bash scripts/device_sweep.sh s22c       # ncu: the FC1 dgrad's n256 plain main loop and the layer's kernel
#   bash scripts/device_sweep.sh s22d       # the passes' shared layouts: GPU tests; the tensor cores' K sums
# Logs are packed into $OUT/logs.tgz at the end (the device tool returns few files).
# Run from the repository root on a two-GPU machine; source scripts/device_env.sh first.
set -u
OUT=${OUT:-/tmp/out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
pack() { [ -d "$LOGS" ] && tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"; }
trap pack EXIT  # also when an outer time limit stops the sweep (TERM is trapped below)
trap 'exit 124' TERM
step() {  # step NAME SECONDS CMD...: run CMD with a limit, log to $OUT/NAME.log, print its rc and key lines
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$?"
  grep -E "^(PASS|FAIL|rank|step|done|transfers|symmetric)|timed out|^\{|FAILED" "$LOGS/$name.log" | cut -c1-300 | tail -20
}
record30() {  # record30 LIMIT: the Qwen3-30B-A3B EP=2 record (torch, both transports, T=4096/16384, profiled), then
              # the symmetric-memory pipeline back to back
  step bench_30b "$1" torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
    --transports symmetric_memory collectives --iters 10 --warmup 3 --out "$LOGS/bench_30b.json" --profile-dir "$LOGS" \
    --profile-backends mega_moe
  tail -8 "$LOGS/bench_30b.log"
  step bench_30b_r5 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
    --transports symmetric_memory --backends mega_moe --repeat 5 --iters 10 --warmup 3 --out "$LOGS/bench_30b_r5.json"
  tail -3 "$LOGS/bench_30b_r5.log"
}
ncu_ws_fc2() {  # ncu_ws_fc2 LIMIT: Nsight Compute on one ws FC2 launch: summary, then stall samples per SASS line
  local ncu_args="--clock-control none --kernel-name regex:fp8_grouped_gemm_ws --launch-skip 2 --launch-count 1"
  step ncu_ws "$1" ncu $ncu_args --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python scripts/fp8_gemm_once.py --gemm fc2 \
    --kernel ws
  grep -E "Duration|Throughput|Warp Cycles|Issued|Eligible|L2 Hit|Pipe|One or More|No Eligible" \
    "$LOGS/ncu_ws.log" | head -30
  step ncu_ws_sass "$1" ncu $ncu_args --section WarpStateStats --section SourceCounters --page source \
    --print-source sass --csv python scripts/fp8_gemm_once.py --gemm fc2 --kernel ws
  wc -l "$LOGS/ncu_ws_sass.log"
}
layer_run() {  # layer_run RUN LIMIT "PRECISIONS" "EXTRA": the Qwen3-30B-A3B layer (T=16384, one GPU) one call, from
               # ab_base/ when RUN starts with "base", else this tree; EXTRA: more bench arguments
  local run=$1 limit=$2 precisions=$3 extra=$4 tree=.
  [ "${run#base}" != "$run" ] && tree=ab_base
  # shellcheck disable=SC2086  # (precisions and extra are word lists)
  (cd $tree && PYTHONPATH=/tmp/site:$PWD step "layer_$run" "$limit" python -m prime_megamoe.bench \
    --shape qwen3-30b-a3b --tokens 16384 --precisions $precisions --iters 5 --warmup 2 --backends mega_moe \
    $extra --out "$LOGS/layer_$run.json"
   tail -4 "$LOGS/layer_$run.log")
}
layer_ab() {  # layer_ab LIMIT "PRECISIONS" "NEW_EXTRA" RUN...: layer_run for each RUN; NEW_EXTRA (more backends, a
              # profile directory) goes to the run named "new"
  local limit=$1 precisions=$2 new_extra=$3 run
  shift 3
  for run in "$@"; do
    if [ "$run" = new ]; then layer_run "$run" "$limit" "$precisions" "$new_extra"
    else layer_run "$run" "$limit" "$precisions" ""; fi
  done
}
fp8_tests_and_layer() {  # the quantised precisions' GPU tests, then the fp8 layer (with torch), one call and back to back
  PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
    -k "gpu or half_tile or tma" -rA
  tail -2 "$LOGS/pytest_fp8.log"
  step fp8_new 180 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
    --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8_new.json"
  tail -4 "$LOGS/fp8_new.log"
  step fp8_new_r5 180 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --backends mega_moe \
    --precisions fp8 fp8_bwd --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_new_r5.json"
  tail -3 "$LOGS/fp8_new_r5.log"
}
gpu_tests() {  # one-GPU tests side by side (bf16 and validation on GPU 1, the quantised precisions on GPU 0), then
               # the EP check (both transports, bitwise)
  CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py \
    tests/test_tile_blocks.py tests/test_validation.py -rA &
  CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
    -k "gpu or half_tile" -rA &
  wait
  tail -2 "$LOGS/pytest_gpu.log"; tail -2 "$LOGS/pytest_fp8.log"
  (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
  grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
}
ab16k() {  # 30B EP=2 T=16384 one call and back to back, this tree against ab_base/ (a git archive of a base commit's
           # prime_megamoe), alternating on one machine
  for run in new_r1a base_r1a new_r5 base_r5 new_r1b base_r1b; do
    tree=.; [ "${run%%_*}" = base ] && tree=ab_base
    r=${run#*_r}; r=${r%[ab]}
    (cd $tree && PYTHONPATH=/tmp/site:$PWD step "bench_$run" 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench \
      --shape qwen3-30b-a3b --tokens 16384 --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 \
      --warmup 3 --out "$LOGS/bench_$run.json")
    tail -1 "$LOGS/bench_$run.log"
  done
}
fp8bench() {  # fp8bench new|base LIMIT ARGS...: fp8 and fp8_bwd, Qwen3-30B-A3B, T=16384, one GPU (GPU 1), profiled, for
              # this tree (new) or ab_base/ (base)
  local which=$1 limit=$2; shift 2
  local tree=.; [ "$which" = base ] && tree=ab_base
  (cd $tree && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site:$PWD step "fp8_$which" "$limit" python -m prime_megamoe.bench \
    --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --iters 5 --warmup 2 "$@" \
    --out "$LOGS/fp8_$which.json" --profile-dir "$LOGS/prof_fp8_$which")
  tail -6 "$LOGS/fp8_$which.log"
}
fp8record() {  # the fp8 record: fp8 / fp8_bwd at T=16384 with torch, one call (profiled) and back to back (GPU 1);
               # EP=2 over collectives (both GPUs)
  fp8bench new 200 --backends torch mega_moe
  (CUDA_VISIBLE_DEVICES=1 step fp8_r5 150 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
    --precisions fp8 fp8_bwd --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_r5.json")
  tail -3 "$LOGS/fp8_r5.log"
  step fp8_ep2 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
    --precisions fp8 fp8_bwd --transports collectives --backends mega_moe --iters 5 --warmup 2 \
    --out "$LOGS/fp8_ep2.json"
  tail -3 "$LOGS/fp8_ep2.log"
}
fp8_layer_one_gpu() {  # fp8_layer_one_gpu TAG: the fp8 layer on one GPU, fp8 / fp8_bwd one call (profiled into
                      # prof_TAG), then fp8 back to back
  step "layer_$1" 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd \
    --backends mega_moe --iters 5 --warmup 2 --profile-dir "$LOGS/prof_$1" --out "$LOGS/layer_$1.json"
  tail -3 "$LOGS/layer_$1.log"
  step "layer_$1_r5" 60 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 \
    --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/layer_$1_r5.json"
  tail -2 "$LOGS/layer_$1_r5.log"
}
timelines() {  # one-call timelines from launch events: the no-grad forward, then forward + backward
  step timeline_fwd 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
  step timeline_grad 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_grad"
  grep -h "call:" "$LOGS"/timeline_*.txt
}
case "${1:-}" in
  ncu_ws)  # Nsight Compute on one FC2 launch: the Triton fp8 kernel, then the warp-specialised one (GPU 0)
    for kern in triton ws; do
      step "ncu_$kern" 240 ncu --clock-control none --kernel-name regex:fp8_grouped_gemm --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section SourceCounters python scripts/fp8_gemm_once.py --gemm fc2 --kernel $kern
      grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Active Warps|Registers|Shared Memory|L2 Hit|Executed Ipc|One or More|No Eligible" \
        "$LOGS/ncu_$kern.log" | head -40
    done ;;
  ncu_src)  # the ws probe rows, then Nsight Compute on one ws FC2 launch: summary, and stall samples per SASS line
    step fp8_probe_ws 240 python scripts/fp8_probe.py --ws-only
    tail -20 "$LOGS/fp8_probe_ws.log"
    ncu_args="--clock-control none --kernel-name regex:fp8_grouped_gemm_ws --launch-skip 2 --launch-count 1"
    step ncu_ws 200 ncu $ncu_args --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      --section MemoryWorkloadAnalysis python scripts/fp8_gemm_once.py --gemm fc2 --kernel ws
    grep -E "Duration|Stall|Warp Cycles|L2 Compression Input|excessive" "$LOGS/ncu_ws.log" | head -20
    step ncu_ws_sass 200 ncu $ncu_args --section WarpStateStats --section SourceCounters --page source \
      --print-source sass --csv python scripts/fp8_gemm_once.py --gemm fc2 --kernel ws
    wc -l "$LOGS/ncu_ws_sass.log" ;;
  ws_layer)  # the layer with the warp-specialised FC1 dgrad: the quantised precisions' GPU tests, then the fp8 layer
             # against ab_base/ (GPU 0), and this tree's layer one call (profiled) and back to back (GPU 1)
    (CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_q 200 python -m pytest -q tests/test_fp8_experts.py \
      tests/test_fp8_gemm_ws.py -k "gpu or half_tile or tma_reads or ws_" -rA
     tail -3 "$LOGS/pytest_q.log"
     cd ab_base && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD step fp8_base 150 python -m prime_megamoe.bench \
      --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --backends mega_moe --iters 5 --warmup 2 \
      --out "$LOGS/fp8_base.json"
     tail -3 "$LOGS/fp8_base.log") &
    CUDA_VISIBLE_DEVICES=1 step fp8_new 150 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --backends torch mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_new.json" \
      --profile-dir "$LOGS/prof_fp8_new"
    tail -4 "$LOGS/fp8_new.log"
    CUDA_VISIBLE_DEVICES=1 step fp8_new_r5 150 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_new_r5.json"
    tail -3 "$LOGS/fp8_new_r5.log"
    wait ;;
  ws2)  # the warp-specialised fp8 GEMM's configs: its GPU tests (GPU 0) beside the probe's ws rows (GPU 1)
    CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 240 python -m pytest -q tests/test_fp8_gemm_ws.py \
      -rA &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe_ws 240 python scripts/fp8_probe.py --ws-only
    wait
    tail -5 "$LOGS/pytest_ws.log"; tail -24 "$LOGS/fp8_probe_ws.log" ;;
  ws1)  # the ws GEMM's configs on a one-GPU machine: its GPU tests, then the probe's ws rows
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 240 python -m pytest -q tests/test_fp8_gemm_ws.py -rA
    tail -5 "$LOGS/pytest_ws.log"
    step fp8_probe_ws 240 python scripts/fp8_probe.py --ws-only
    tail -24 "$LOGS/fp8_probe_ws.log" ;;
  s14a)  # the ws weight gradient: smoke launches under a watchdog, then (when they pass) its GPU tests, the probe's
         # weight-gradient rows, the quantised precisions' GPU tests and the layer against ab_base/ (which runs the
         # Triton weight gradients); ab_base/ alone when the smoke fails
    step wgrad_smoke 150 python scripts/fp8_ws_smoke.py wgrad --watchdog 45
    tail -4 "$LOGS/wgrad_smoke.log"
    if grep -q "^PASS" "$LOGS/wgrad_smoke.log"; then
      PRIME_MEGAMOE_AUTOTUNE=0 step pytest_wgrad 120 python -m pytest -q tests/test_fp8_gemm_ws.py -k "wgrad or nothing" -rA
      tail -2 "$LOGS/pytest_wgrad.log"
      step fp8_probe_dw 150 python scripts/fp8_probe.py --ws-only --gemms dW1 dW2
      tail -14 "$LOGS/fp8_probe_dw.log"
      PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 150 python -m pytest -q tests/test_fp8_experts.py -k "gpu or half_tile or tma" -rA
      tail -2 "$LOGS/pytest_fp8.log"
      step fp8_new 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --precisions fp8 fp8_bwd --backends torch mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_new.json"
      tail -4 "$LOGS/fp8_new.log"
    fi
    (cd ab_base && PYTHONPATH=/tmp/site:$PWD step fp8_base 100 python -m prime_megamoe.bench --shape qwen3-30b-a3b \
      --tokens 16384 --precisions fp8 fp8_bwd --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_base.json")
    tail -3 "$LOGS/fp8_base.log"
    step fp8_new_r5 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --backends mega_moe \
      --precisions fp8 fp8_bwd --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_new_r5.json"
    tail -3 "$LOGS/fp8_new_r5.log" ;;
  s14b)  # the ws FC1 + SwiGLU: smoke launches under a watchdog, then (when they pass) its GPU tests, the probe's FC1
         # rows, the quantised precisions' GPU tests and the layer against ab_base/ (Triton FC1), back to back last
    step fc1_smoke 120 python scripts/fp8_ws_smoke.py fc1 --watchdog 45
    tail -6 "$LOGS/fc1_smoke.log"
    if grep -q "^PASS" "$LOGS/fc1_smoke.log"; then
      PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fc1 120 python -m pytest -q tests/test_fp8_gemm_ws.py -k "fc1" -rA
      tail -2 "$LOGS/pytest_fc1.log"
      step fp8_probe_fc1 120 python scripts/fp8_probe.py --ws-only --gemms "FC1 + SwiGLU"
      tail -5 "$LOGS/fp8_probe_fc1.log"
      PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 150 python -m pytest -q tests/test_fp8_experts.py -k "gpu or half_tile or tma" -rA
      tail -2 "$LOGS/pytest_fp8.log"
      step fp8_new 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --precisions fp8 --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_new.json"
      tail -2 "$LOGS/fp8_new.log"
      (cd ab_base && PYTHONPATH=/tmp/site:$PWD step fp8_base 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b \
        --tokens 16384 --precisions fp8 --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_base.json")
      tail -2 "$LOGS/fp8_base.log"
      step fp8_new_r5 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --backends mega_moe \
        --precisions fp8 --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_new_r5.json"
      tail -2 "$LOGS/fp8_new_r5.log"
    fi ;;
  s15a)  # the second ws FC1 + SwiGLU (efd82f1): smoke launches under a watchdog, then (when they pass) the probe's FC1
         # rows, its GPU tests, and the layer with FC1 on it (a copy of the tree with the one-argument change, its GPU
         # tests, one call, back to back) against this tree (Triton FC1)
    step fc1_smoke 150 python scripts/fp8_ws_smoke.py fc1 --watchdog 45
    tail -6 "$LOGS/fc1_smoke.log"
    if grep -q "^PASS" "$LOGS/fc1_smoke.log"; then
      step fp8_probe_fc1 120 python scripts/fp8_probe.py --ws-only --gemms "FC1 + SwiGLU"
      tail -6 "$LOGS/fp8_probe_fc1.log"
      PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fc1 120 python -m pytest -q tests/test_fp8_gemm_ws.py -k "fc1" -rA
      tail -2 "$LOGS/pytest_fc1.log"
      rm -rf /tmp/fc1_tree && mkdir /tmp/fc1_tree && cp -r prime_megamoe tests pyproject.toml /tmp/fc1_tree/
      sed -i 's/h_dtype=rows.dtype if need_grad else None)$/h_dtype=rows.dtype if need_grad else None, use_ws=None)/' \
        /tmp/fc1_tree/prime_megamoe/ops/quantized_experts.py
      grep -c "need_grad else None, use_ws=None)" /tmp/fc1_tree/prime_megamoe/ops/quantized_experts.py
      (cd /tmp/fc1_tree && PYTHONPATH=/tmp/site:$PWD:$OLDPWD/.pylib PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8_fc1ws 150 \
        python -m pytest -q tests/test_fp8_experts.py -k "gpu or half_tile or tma" -rA
       tail -2 "$LOGS/pytest_fp8_fc1ws.log"
       PYTHONPATH=/tmp/site:$PWD step fp8_fc1ws 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --precisions fp8 --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_fc1ws.json"
       tail -2 "$LOGS/fp8_fc1ws.log")
      step fp8_base 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 \
        --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_base.json"
      tail -2 "$LOGS/fp8_base.log"
      (cd /tmp/fc1_tree && PYTHONPATH=/tmp/site:$PWD step fp8_fc1ws_r5 90 python -m prime_megamoe.bench \
        --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 --backends mega_moe --repeat 5 --iters 5 --warmup 2 \
        --out "$LOGS/fp8_fc1ws_r5.json"
       tail -2 "$LOGS/fp8_fc1ws_r5.log")
    fi ;;
  s15b)  # the ws kernels through the compiled-kernel cache: the quantised precisions' GPU tests, then the layer (fp8,
         # fp8_bwd, one call) this tree (profiled first) against ab_base/ (git archive of the commit before),
         # alternating
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 200 python -m pytest -q tests/test_fp8_experts.py \
      -k "gpu or half_tile or tma" -rA
    tail -2 "$LOGS/pytest_fp8.log"
    for run in new_a base_a new_b base_b; do
      tree=.; [ "${run%%_*}" = base ] && tree=ab_base
      prof=(); [ "$run" = new_a ] && prof=(--profile-dir "$LOGS/prof_fp8")
      (cd $tree && PYTHONPATH=/tmp/site:$PWD step "fp8_$run" 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b \
        --tokens 16384 --precisions fp8 fp8_bwd --backends mega_moe --iters 5 --warmup 2 "${prof[@]}" \
        --out "$LOGS/fp8_$run.json"
       tail -3 "$LOGS/fp8_$run.log")
    done ;;
  s15c)  # the backward's two lanes (commit c915442; dropped after, fp8_lanes_s15.txt): the quantised precisions' GPU
         # tests (with the lanes' bitwise test), then the layer (fp8, fp8_bwd, one call) for several SM counts left to
         # the passes (0: one stream), the 16 one profiled
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 220 python -m pytest -q tests/test_fp8_experts.py \
      -k "gpu or half_tile or tma or lanes" -rA
    tail -2 "$LOGS/pytest_fp8.log"
    for spare in 16 0 8 24 32; do
      prof=(); [ "$spare" = 16 ] && prof=(--profile-dir "$LOGS/prof_side16")
      PRIME_MEGAMOE_BACKWARD_SIDE_SMS=$spare step "fp8_side$spare" 120 python -m prime_megamoe.bench \
        --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --backends mega_moe --iters 5 --warmup 2 \
        "${prof[@]}" --out "$LOGS/fp8_side$spare.json"
      tail -2 "$LOGS/fp8_side$spare.log"
    done ;;
  s15d)  # the backward's memory-bound passes in several block shapes / warp counts, then the layer (fp8, fp8_bwd,
         # with torch) one call and back to back
    step pass_probe 200 python scripts/fp8_pass_probe.py
    tail -5 "$LOGS/pass_probe.log"
    step fp8_rec 150 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd \
      --backends torch mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_rec.json"
    tail -5 "$LOGS/fp8_rec.log"
    step fp8_rec_r5 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd \
      --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_rec_r5.json"
    tail -3 "$LOGS/fp8_rec_r5.log" ;;
  s15e|s15f)  # the one-pass SwiGLU backward: its GPU tests and the quantised precisions', the pass probe, then the
              # layer (fp8, fp8_bwd) one call (profiled) and back to back, against ab_base/ (two launches); s15f ran
              # after its copies became asynchronous, with torch in the profiled run
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fused 240 python -m pytest -q tests/test_swiglu_grad_fused.py \
      tests/test_fp8_experts.py -k "fused or gpu or half_tile" -rA
    tail -2 "$LOGS/pytest_fused.log"
    step pass_probe 150 python scripts/fp8_pass_probe.py
    tail -7 "$LOGS/pass_probe.log"
    first=(mega_moe); [ "$1" = s15f ] && first=(torch mega_moe)
    for run in new base new_r5 base_r5; do
      tree=.; [ "${run%%_*}" = base ] && tree=ab_base
      extra=(--backends mega_moe); [ "$run" = new ] && extra=(--backends "${first[@]}" --profile-dir "$LOGS/prof_fused")
      [ "${run#*_}" = r5 ] && extra=(--backends mega_moe --repeat 5)
      (cd $tree && PYTHONPATH=/tmp/site:$PWD step "fp8_$run" 120 python -m prime_megamoe.bench \
        --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --iters 5 --warmup 2 "${extra[@]}" \
        --out "$LOGS/fp8_$run.json"
       tail -3 "$LOGS/fp8_$run.log")
    done ;;
  s15g)  # the sorting placement kernel: its GPU test at the layer's scale, the fp8 oracle tests, then the fp8 layer
         # one call (profiled) and back to back
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_sort 150 python -m pytest -q tests/test_mega_moe_kernels.py \
      tests/test_fp8_experts.py -k "on_gpu or gpu_against_oracle" -rA
    tail -2 "$LOGS/pytest_sort.log"
    step fp8_sort 90 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 \
      --backends mega_moe --iters 5 --warmup 2 --profile-dir "$LOGS/prof_sort" --out "$LOGS/fp8_sort.json"
    tail -2 "$LOGS/fp8_sort.log"
    step fp8_sort_r5 60 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 \
      --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/fp8_sort_r5.json"
    tail -2 "$LOGS/fp8_sort_r5.log" ;;
  s16a)  # the placement kernel's GPU test and the fp8 oracle tests; fp8 one-call timelines (launch events, host
         # sections); Nsight Compute on the backward's memory passes (SwiGLU rows / columns, x^T, dy^T) and on dW1
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_sort 150 python -m pytest -q tests/test_mega_moe_kernels.py \
      tests/test_fp8_experts.py -k "on_gpu or gpu_against_oracle" -rA
    tail -2 "$LOGS/pytest_sort.log"
    for what in fwd grad; do
      flag=""; [ $what = grad ] && flag=--grad
      step "timeline_$what" 90 python scripts/call_timeline.py --precision fp8 $flag --out "$LOGS/timeline_$what"
      tail -4 "$LOGS/timeline_$what.log"
      step "sections_$what" 90 python scripts/call_timeline.py --precision fp8 $flag --host-sections
      tail -3 "$LOGS/sections_$what.log"
    done
    step ncu_passes 200 ncu --clock-control none --kernel-name regex:"swiglu_backward_quantize|gather_quantize_cols_t" \
      --launch-skip 4 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section LaunchStats --section SourceCounters python scripts/call_timeline.py --precision fp8 --grad
    grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Achieved Occ" \
      "$LOGS/ncu_passes.log" | head -40
    step ncu_wgrad 120 ncu --clock-control none --kernel-name regex:fp8_grouped_wgrad_ws --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python scripts/call_timeline.py \
      --precision fp8 --grad
    grep -E "Duration|Throughput|Warp Cycles|Issued|Eligible|Pipe" "$LOGS/ncu_wgrad.log" | head -20 ;;
  s16b)  # the backward's memory passes in several configs (launches alone, CUDA events), then where one fp8
         # forward's host time goes, piece by piece
    step pass_probe 240 python scripts/fp8_pass_probe.py
    tail -40 "$LOGS/pass_probe.log"
    step sections_deep 90 python scripts/call_timeline.py --precision fp8 --host-sections --deep
    grep -A80 "call 2" "$LOGS/sections_deep.log" | cut -c1-120 ;;
  s16c)  # the pooled routing plans, the row quantiser launched without views, the passes' new configs: GPU tests
         # (quantised precisions, the bf16 layer's, the one-pass SwiGLU kernel against the two launches), then the
         # layer one call (fp8, fp8_bwd, bf16) alternating with ab_base/ (the session's starting code), back to back,
         # and where one fp8 forward's host time goes
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s16 300 python -m pytest -q tests/test_fp8_experts.py \
      tests/test_swiglu_grad_fused.py tests/test_mega_moe_kernels.py -k "gpu or half_tile or tma or fused" -rA
    tail -3 "$LOGS/pytest_s16.log"
    layer_ab 150 "fp8 fp8_bwd bf16" "--profile-dir $LOGS/prof_s16" new base new2 base2
    step layer_r5 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd \
      --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/layer_r5.json"
    tail -3 "$LOGS/layer_r5.log"
    step sections 90 python scripts/call_timeline.py --precision fp8 --host-sections --deep
    grep -A40 "call 2" "$LOGS/sections.log" | cut -c1-100 ;;
  s16d)  # no-grad forwards without the autograd function, weight descriptors kept, x quantised by the routing launch:
         # GPU tests (quantised precisions, ws kernels, the bf16 layer's), the layer one call (fp8, fp8_bwd, bf16; the
         # first run with torch, profiled) alternating with ab_base/, back to back, the forward's host sections
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s16d 300 python -m pytest -q tests/test_fp8_experts.py \
      tests/test_fp8_gemm_ws.py tests/test_mega_moe_gpu.py tests/test_mega_moe_kernels.py -k "gpu or half_tile" -rA
    tail -3 "$LOGS/pytest_s16d.log"
    layer_ab 150 "fp8 fp8_bwd bf16" "--backends torch mega_moe --profile-dir $LOGS/prof_s16d" new base new2 base2
    step layer_r5 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd \
      --backends mega_moe --repeat 5 --iters 5 --warmup 2 --out "$LOGS/layer_r5.json"
    tail -3 "$LOGS/layer_r5.log"
    step sections 90 python scripts/call_timeline.py --precision fp8 --host-sections --deep
    grep -A40 "call 2" "$LOGS/sections.log" | cut -c1-100 ;;
  s16e)  # more one-call samples of the final layer against ab_base/ (fp8, fp8_bwd), alternating, three times each
    layer_ab 100 "fp8 fp8_bwd" "" new base new2 base2 new3 base3 ;;
  s16f)  # the SwiGLU backward's column pass in Gluon: its GPU tests and the quantised oracle tests, the pass probe
         # (against the Triton launch), the fp8 layer one call (profiled) against ab_base/ (the Triton launch),
         # alternating
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_cols 200 python -m pytest -q tests/test_swiglu_grad_cols.py \
      tests/test_fp8_experts.py -k "gpu or cols" -rA
    tail -3 "$LOGS/pytest_cols.log"
    step pass_probe 150 python scripts/fp8_pass_probe.py
    grep -E "cols|best" "$LOGS/pass_probe.log" | head -20
    layer_ab 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s16f" new base new2 base2 ;;
  s22d)  # the transposing Gluon passes with their layouts from one constexpr function: their GPU tests; then the
         # error of the whole K summed in the tensor cores against the promotion (the ceiling script's --accuracy)
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s22d 200 python -m pytest -q tests/test_gather_cols_t.py \
      tests/test_swiglu_grad_cols.py -m gpu -rA
    tail -3 "$LOGS/pytest_s22d.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s22d.log" | head -10
    step accuracy_s22d 150 python scripts/fp8_ws_ceiling.py --accuracy
    tail -3 "$LOGS/accuracy_s22d.log" ;;
  s22c)  # Nsight Compute on the FC1 dgrad: the n256 plain main loop (the ceiling script's variant) and the layer's
         # kernel (default config), memory and tensor throughput
    ncu_args="--clock-control none --launch-skip 1 --launch-count 1 --section SpeedOfLight"
    ncu_args="$ncu_args --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    # shellcheck disable=SC2086
    step ncu_n256 150 ncu $ncu_args --kernel-name regex:ws_variant_kernel python scripts/fp8_ws_ceiling.py \
      --gemm "FC1 dgrad" --variant "n256 plain, no store"
    # shellcheck disable=SC2086
    step ncu_layer 150 ncu $ncu_args --kernel-name regex:fp8_grouped_gemm_ws python scripts/fp8_ws_ceiling.py \
      --gemm "FC1 dgrad" --variant "ws (layer)"
    for f in ncu_n256 ncu_layer; do
      grep -E "Duration|Throughput|L2 Hit|Pipe|Busy|Bandwidth" "$LOGS/$f.log" | head -24
    done ;;
  s22b)  # the ceiling script with one 64 x 256 accumulator a partition (n256 wgmma; plain, and rescaled by row each
         # step), then the layer with fp8_bwd first and fp8 second (profiled), the SM clocks sampled beside it
    python3 -c "from triton.experimental import gluon; print('gluon.constexpr_function:', hasattr(gluon, 'constexpr_function'))"
    step ceiling_s22b 200 python scripts/fp8_ws_ceiling.py
    tail -22 "$LOGS/ceiling_s22b.log"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 200 \
      > "$LOGS/smi_s22b.csv" 2>&1 &
    smi=$!
    step layer_s22b 120 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 --precisions fp8_bwd fp8 \
      --backends mega_moe --iters 5 --warmup 2 --profile-dir "$LOGS/prof_s22b" --out "$LOGS/layer_s22b.json"
    kill $smi
    tail -3 "$LOGS/layer_s22b.log"
    for f in "$LOGS"/prof_s22b/*.trace.json.gz; do python scripts/backward_span.py "$f" | head -4; done ;;
  s22a)  # pipelined promotion (WS_CONFIGS[6]: each step's promotion under the next step's wgmma): the ws GEMMs'
         # GPU tests (every config against the Triton kernels), then the probe: configs 0 (128 columns), 1 (the
         # default, 256 columns) and 6 (pipelined) on every ws GEMM of the layer
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s22a 240 python -m pytest -q tests/test_fp8_gemm_ws.py -m gpu \
      -k "matches or nothing" -rA
    tail -3 "$LOGS/pytest_s22a.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s22a.log" | head -10
    step probe_s22a 200 python scripts/fp8_probe.py --ws-only --gemms FC2 "FC2 dgrad" "FC1 dgrad" dW1 dW2 \
      --configs 0 1 6
    tail -24 "$LOGS/probe_s22a.log" ;;
  s21g)  # the one-pass SwiGLU backward with 16 warps an SM as well as 8: its GPU tests (8 warps, the default; the
         # second sweep's layout now derived from RB and the warps), then the pass probe with both
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21g 120 python -m pytest -q tests/test_swiglu_grad_fused.py \
      -k "matches or nothing" -rA
    tail -3 "$LOGS/pytest_s21g.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21g.log" | head -10
    step pass_probe_s21g 150 python scripts/fp8_pass_probe.py
    grep -E "SwiGLU bwd|best|  " "$LOGS/pass_probe_s21g.log" | tail -9 ;;
  s21f)  # the session's final package: the fp8 layer one call (profiled) and back to back, a second one-call
         # run, and the CUDA-graph capture test (the ws FC1's quantiser changed)
    fp8_layer_one_gpu s21f
    layer_run new 90 "fp8 fp8_bwd" ""
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21f 120 python -m pytest -q tests/test_mega_moe_gpu.py -k "graph" -rA
    tail -3 "$LOGS/pytest_s21f.log" ;;
  s21e)  # the two transposing Gluon passes after they came to share their block set-up: their GPU tests against
         # the Triton launches, then the pass probe
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21e 150 python -m pytest -q tests/test_gather_cols_t.py \
      tests/test_swiglu_grad_cols.py -k "matches or nothing" -rA
    tail -3 "$LOGS/pytest_s21e.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21e.log" | head -10
    step pass_probe_s21e 150 python scripts/fp8_pass_probe.py
    grep -E "Gluon|SwiGLU bwd|best|  " "$LOGS/pass_probe_s21e.log" | tail -22 ;;
  s21d)  # the one-pass SwiGLU backward with dg, du and w * a stashed in shared memory (persistent, one program an
         # SM): its GPU tests against the two launches, the pass probe, then the layer (fp8, fp8_bwd) one call with
         # it (a copy of this tree whose fp8_fc2_dgrad_dswiglu defaults to fused=None) against this tree,
         # alternating, the first pair profiled
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21d 150 python -m pytest -q tests/test_swiglu_grad_fused.py \
      -k "matches or nothing" -rA
    tail -3 "$LOGS/pytest_s21d.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21d.log" | head -10
    step pass_probe_s21d 150 python scripts/fp8_pass_probe.py
    grep -E "SwiGLU bwd|best|  " "$LOGS/pass_probe_s21d.log" | tail -8
    rm -rf ab_fused && mkdir ab_fused && cp -r prime_megamoe ab_fused/ && python - <<'PY'
p = "ab_fused/prime_megamoe/ops/fp8_launch.py"
s = open(p).read()
old = "fmt: QFormat, *, fused: bool | None = False) -> DSwiGLUOut:\n    \"\"\"``fp8_fc2_dgrad``"
assert old in s, "the layer's fused default not found"
open(p, "w").write(s.replace(old, old.replace("= False", "= None")))
PY
    for run in fused new fused2 new2; do
      tree=.; [ "${run#fused}" != "$run" ] && tree=ab_fused
      prof=""; [ "$run" = fused ] || [ "$run" = new ] && prof="--profile-dir $LOGS/prof_s21d_$run"
      # shellcheck disable=SC2086
      (cd $tree && PYTHONPATH=/tmp/site:$PWD step "layer_$run" 90 python -m prime_megamoe.bench \
        --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --iters 5 --warmup 2 --backends mega_moe \
        $prof --out "$LOGS/layer_$run.json"; tail -3 "$LOGS/layer_$run.log")
    done ;;
  s21c)  # the session's package (the gather pass on 64 columns, 8 a thread): the passes' GPU tests and the quantised
         # oracle tests, the layer (fp8, fp8_bwd) one call against ab_base/ (80ed13f) alternating, the first pair
         # profiled, then the fp8 layer record (one call profiled, back to back)
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21c 200 python -m pytest -q tests/test_gather_cols_t.py \
      tests/test_swiglu_grad_cols.py tests/test_fp8_experts.py -k "gpu" -rA
    tail -3 "$LOGS/pytest_s21c.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21c.log" | head -10
    for run in new base; do layer_run $run 90 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s21c_$run"; done
    for run in new2 base2; do layer_run $run 90 "fp8 fp8_bwd" ""; done
    fp8_layer_one_gpu s21c ;;
  s21b)  # the wgrads' gather pass in Gluon with CPT columns a thread, the column pass on two columns a thread:
         # their GPU tests and the quantised oracle tests, the pass probe, then the layer (fp8, fp8_bwd) one call
         # against ab_base/ (80ed13f: the session's start), alternating, the first pair profiled
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21b 200 python -m pytest -q tests/test_gather_cols_t.py \
      tests/test_swiglu_grad_cols.py tests/test_fp8_experts.py -k "gpu or matches or nothing" -rA
    tail -3 "$LOGS/pytest_s21b.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21b.log" | head -10
    step pass_probe_s21b 200 python scripts/fp8_pass_probe.py
    grep -E "Gluon|gather|best|  " "$LOGS/pass_probe_s21b.log" | tail -24
    for run in new base; do layer_run $run 90 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s21b_$run"; done
    for run in new2 base2; do layer_run $run 90 "fp8 fp8_bwd" ""; done ;;
  s21a)  # the persistent one-pass SwiGLU backward and the quantisers without the clamp before the saturating
         # conversion: their GPU tests against the Triton passes, then the pass probe (every config, both forms)
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s21a 240 python -m pytest -q tests/test_swiglu_grad_fused.py \
      tests/test_swiglu_grad_cols.py tests/test_fp8_gemm_ws.py -k "(matches or nothing) and not wgrad and not ws_gemm" -rA
    tail -3 "$LOGS/pytest_s21a.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s21a.log" | head -10
    step pass_probe_s21a 200 python scripts/fp8_pass_probe.py
    tail -22 "$LOGS/pass_probe_s21a.log" ;;
  s20e)  # the session's package: the fp8 layer one call (profiled) and back to back, the fp8 forward in a CUDA graph
    fp8_layer_one_gpu s20e
    step graph_probe_fp8 100 python scripts/graph_probe.py --precisions fp8
    tail -3 "$LOGS/graph_probe_fp8.log" ;;
  s20d)  # the gathering FC2 dgrad on 256-column tiles (every ws GEMM's default now): the probe (WS_CONFIGS 0, 1),
         # then the layer (fp8, fp8_bwd) one call against ab_base/ (4d03519), alternating, both first runs profiled
    step probe_s20d 120 python scripts/fp8_probe.py --ws-only --gemms "FC2 dgrad" --configs 0 1
    tail -6 "$LOGS/probe_s20d.log"
    for run in new base; do layer_run $run 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s20d_$run"; done
    for run in new2 base2; do layer_run $run 100 "fp8 fp8_bwd" ""; done ;;
  s20c)  # the weight gradient's staggered default: its GPU tests, the graph probe with relaxed capture, the GEMMs
         # per config once more (WS_CONFIGS 0-2), then the layer
         # (fp8, fp8_bwd) one call against ab_base/ (4d03519: the session's start), alternating, both first runs
         # profiled
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s20c 150 python -m pytest -q tests/test_fp8_gemm_ws.py \
      -k "wgrad and (matches or nothing)" -rA
    tail -3 "$LOGS/pytest_s20c.log"
    step graph_relaxed 80 python scripts/graph_probe.py --precisions fp8 --error-mode relaxed
    tail -4 "$LOGS/graph_relaxed.log"
    step probe_s20c 150 python scripts/fp8_probe.py --ws-only --gemms "FC2 dgrad" dW1 dW2 --configs 0 1 2
    tail -20 "$LOGS/probe_s20c.log"
    for run in new base; do layer_run $run 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s20c_$run"; done
    for run in new2 base2; do layer_run $run 100 "fp8 fp8_bwd" ""; done ;;
  s20b)  # the staggered config (WS_CONFIGS[2]) on the GPU: the ws kernels' tests (ragged routing, every config,
         # 1 and 3 programs, ranks without tiles) and compile checks with this Triton; then the graph probe
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s20b 330 python -m pytest -q tests/test_fp8_gemm_ws.py -rA
    tail -3 "$LOGS/pytest_s20b.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s20b.log" | head -10
    for prec in fp8 bf16; do
      step graph_probe_$prec 100 python scripts/graph_probe.py --precisions $prec
      tail -4 "$LOGS/graph_probe_$prec.log"
    done ;;
  s20a)  # staggered MMA partitions and two output boxes a partition (an out_bufs config, dropped after this run):
         # the GEMMs per config (probe), then the no-grad forward captured in a CUDA graph
    step probe_s20a 330 python scripts/fp8_probe.py --ws-only --gemms FC2 "FC1 dgrad" "FC2 dgrad" dW1 dW2 \
      --configs 0 1 3 4 5 6
    tail -40 "$LOGS/probe_s20a.log"
    step graph_probe 150 python scripts/graph_probe.py --precisions fp8 bf16
    tail -8 "$LOGS/graph_probe.log" ;;
  graphs)  # the no-grad forward (fp8, bf16) captured in a CUDA graph: whether it captures, the replay's bits and
           # its one-call and back-to-back times against the eager forward (scripts/graph_probe.py; one precision a
           # process: a failed capture leaves the CUDA generator unusable)
    for prec in fp8 bf16; do
      step graph_probe_$prec 150 python scripts/graph_probe.py --precisions $prec
      tail -4 "$LOGS/graph_probe_$prec.log"
    done ;;
  s19d)  # the ws kernels' compile checks with this machine's Triton (the 256-column GEMM's stacked scalars), then
         # the layer (fp8, fp8_bwd) one call against ab_base/ (95b3434: the session's start), alternating; the first
         # pair profiled
    step pytest_s19d 150 python -m pytest -q tests/test_fp8_gemm_ws.py -k "compiles" -rA
    tail -3 "$LOGS/pytest_s19d.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s19d.log" | head -10
    for run in new base; do layer_run $run 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s19d_$run"; done
    for run in new2 base2; do layer_run $run 100 "fp8 fp8_bwd" ""; done ;;
  s19c)  # the 256-column defaults (FC2, FC1 dgrad, weight gradients): the ws kernels' GPU tests (ragged routing,
         # partial column parts, a rank with no rows) and the quantised layer's oracle tests on the GPU, then the
         # layer (fp8, fp8_bwd) one call, profiled, and fp8 back to back
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s19c 300 python -m pytest -q tests/test_fp8_gemm_ws.py \
      tests/test_fp8_experts.py -k "gemm_matches or receives_nothing or wgrad_matches or gpu_against_oracle" -rA
    tail -3 "$LOGS/pytest_s19c.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s19c.log" | head -20
    fp8_layer_one_gpu s19c ;;
  s19b)  # the row-tiled GEMMs (FC2, FC2 dgrad, FC1 dgrad) on 256-column tiles too: their GPU tests (compiled with
         # this machine's Triton; every config against the Triton kernel), the GEMMs per config, then the layer one
         # call against ab_base/ (27667ab: the weight gradient's 256-column tiles only), alternating
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s19b 200 python -m pytest -q tests/test_fp8_gemm_ws.py -k "not fc1" -rA
    tail -3 "$LOGS/pytest_s19b.log"
    grep -E "^(FAILED|E  )" "$LOGS/pytest_s19b.log" | head -20
    step probe_s19b 200 python scripts/fp8_probe.py --ws-only --gemms FC2 "FC2 dgrad" "FC1 dgrad"
    tail -24 "$LOGS/probe_s19b.log"
    layer_ab 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s19b" new base new2 base2 ;;
  s19a)  # the weight gradient on 256-column tiles (two accumulators an MMA partition): its GPU tests (compiled with
         # this machine's Triton; every config against the Triton kernel), dW1 / dW2 per config, then the layer one
         # call against ab_base/ (the package before it), alternating, the first "new" run profiled
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s19a 200 python -m pytest -q tests/test_fp8_gemm_ws.py -k "wgrad" -rA
    tail -3 "$LOGS/pytest_s19a.log"
    step probe_s19a 200 python scripts/fp8_probe.py --ws-only --gemms dW1 dW2
    tail -16 "$LOGS/probe_s19a.log"
    layer_ab 100 "fp8 fp8_bwd" "--profile-dir $LOGS/prof_s19a" new base new2 base2 ;;
  s16g)  # the plan's expert tile ranges (no tile-offset kernels in the backward): GPU tests (the placement at the
         # layer's scale, the quantised oracle tests, the ws weight gradient, the column pass's), then the layer
         # (fp8, fp8_bwd) one call (profiled) and fp8 back to back
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_s16g 150 python -m pytest -q tests/test_mega_moe_kernels.py \
      tests/test_fp8_experts.py tests/test_fp8_gemm_ws.py tests/test_swiglu_grad_cols.py \
      -k "on_gpu or gpu_against_oracle or wgrad_matches or cols" -rA
    tail -3 "$LOGS/pytest_s16g.log"
    fp8_layer_one_gpu s16g ;;
  ncu_fc1)  # Nsight Compute on one FC1 + SwiGLU launch: the Triton kernel, then the warp-specialised one
    for kern in triton ws; do
      step "ncu_fc1_$kern" 80 ncu --clock-control none --kernel-name regex:fp8_fc1_swiglu --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section ComputeWorkloadAnalysis python scripts/fp8_gemm_once.py --gemm fc1 --kernel $kern
      grep -E "Duration|Throughput|Pipe|L2 Hit|L1/TEX Hit|Warp Cycles|Stall" "$LOGS/ncu_fc1_$kern.log" | head -24
    done ;;
  s13b)  # where the ws kernel's time goes (variants without promotion / stores), Nsight Compute on its FC2 (summary,
         # stall samples per SASS line), the quantised precisions' GPU tests, the layer (this tree; ab_base/ between its
         # one-call and back-to-back runs when it ran)
    step ceiling 240 python scripts/fp8_ws_ceiling.py
    tail -12 "$LOGS/ceiling.log"
    ncu_ws_fc2 200
    fp8_tests_and_layer
    (cd ab_base && PYTHONPATH=/tmp/site:$PWD step fp8_base 180 python -m prime_megamoe.bench --shape qwen3-30b-a3b \
      --tokens 16384 --precisions fp8 fp8_bwd --backends mega_moe --iters 5 --warmup 2 --out "$LOGS/fp8_base.json")
    tail -3 "$LOGS/fp8_base.log" ;;
  s13c)  # after a ws kernel change: its GPU tests, the probe's ws rows, the variants without promotion / stores, the
         # quantised precisions' GPU tests, the layer (one call, then back to back)
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 240 python -m pytest -q tests/test_fp8_gemm_ws.py -rA
    tail -3 "$LOGS/pytest_ws.log"
    step fp8_probe_ws 240 python scripts/fp8_probe.py --ws-only
    tail -24 "$LOGS/fp8_probe_ws.log"
    step ceiling 240 python scripts/fp8_ws_ceiling.py
    tail -10 "$LOGS/ceiling.log"
    fp8_tests_and_layer ;;
  s13d)  # the ws probe rows (with a 5-stage config when it ran), then Nsight Compute on the layer's ws FC2
    step fp8_probe_ws 150 python scripts/fp8_probe.py --ws-only
    tail -22 "$LOGS/fp8_probe_ws.log"
    ncu_ws_fc2 120 ;;
  s13e)  # the ws probe rows, then the ws kernel's GPU tests (a short device budget: the probe first)
    step fp8_probe_ws 100 python scripts/fp8_probe.py --ws-only
    tail -18 "$LOGS/fp8_probe_ws.log"
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 120 python -m pytest -q tests/test_fp8_gemm_ws.py -rA
    tail -2 "$LOGS/pytest_ws.log" ;;
  s13a)  # the ws GEMM's configs (GPU tests beside the probe, as ws2), then fp8 / fp8_bwd at EP=2 over collectives,
         # where the FC1 dgrad now runs the ws kernel
    CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 240 python -m pytest -q tests/test_fp8_gemm_ws.py \
      -rA &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe_ws 240 python scripts/fp8_probe.py --ws-only
    wait
    tail -5 "$LOGS/pytest_ws.log"; tail -24 "$LOGS/fp8_probe_ws.log"
    step fp8_ep2 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --transports collectives --iters 5 --warmup 2 --out "$LOGS/fp8_ep2.json"
    tail -6 "$LOGS/fp8_ep2.log" ;;
  ws)  # the warp-specialised fp8 GEMM: its GPU tests then the layer against ab_base/ (GPU 0); the fp8 probe with its
       # rows then the layer with this tree (GPU 1)
    (CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ws 200 python -m pytest -q tests/test_fp8_gemm_ws.py \
      tests/test_fp8_experts.py -k "gpu or half_tile or tma or ws" -rA
     tail -3 "$LOGS/pytest_ws.log"
     cd ab_base && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD step fp8_base 180 python -m prime_megamoe.bench \
      --shape qwen3-30b-a3b --tokens 16384 --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8_base.json"
     tail -4 "$LOGS/fp8_base.log") &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe 300 python scripts/fp8_probe.py
    tail -24 "$LOGS/fp8_probe.log"
    CUDA_VISIBLE_DEVICES=1 step fp8_new 180 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8_new.json" --profile-dir "$LOGS/prof_fp8_new"
    tail -4 "$LOGS/fp8_new.log"
    wait ;;
  check)
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 240 torchrun --nproc-per-node 2 gpu_check_ep.py)
    (cd scripts && step timeout_check 90 torchrun --nproc-per-node 2 gpu_check_timeout.py) ;;
  bench)
    step bench_30b 420 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
      --transports symmetric_memory collectives --iters 10 --warmup 3 --out "$LOGS/bench_30b.json" --profile-dir "$LOGS"
    step bench_30b_repeat 240 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --transports symmetric_memory --repeat 5 --iters 10 --warmup 3 --out "$LOGS/bench_30b_repeat.json" ;;
  train)
    for c in tiny tiny-torch; do
      step "train_$c" 180 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/$c.toml --train.steps 10 \
        --output-dir "/tmp/$c"
      cp "/tmp/$c/metrics.jsonl" "$LOGS/metrics_$c.jsonl"
    done ;;
  probe)
    (cd scripts && CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step check_1gpu 150 python gpu_check.py) &
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step fp8_profile 200 python -m prime_megamoe.bench \
      --shape qwen3-30b-a3b --tokens 16384 --backends mega_moe --precisions fp8 fp8_bwd --iters 5 --warmup 2 \
      --out "$LOGS/fp8.json" --profile-dir "$LOGS"
    wait
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 150 torchrun --nproc-per-node 2 gpu_check_ep.py)
    for r in 1 5; do
      step "bench_16k_r$r" 240 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --repeat $r --iters 10 --warmup 3 --out "$LOGS/bench_16k_r$r.json"
      tail -8 "$LOGS/bench_16k_r$r.log"
    done ;;
  pipeline)  # after a pipeline change: EP check, EP=2 T=16384 timings (profiled) and the wgrad gather probe
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 150 torchrun --nproc-per-node 2 gpu_check_ep.py)
    CUDA_VISIBLE_DEVICES=0 step wgrad_probe 200 python scripts/wgrad_probe.py --segments 2 &
    CUDA_VISIBLE_DEVICES=1 step wgrad_probe_ep1 200 python scripts/wgrad_probe.py --segments 1
    wait
    cat "$LOGS/wgrad_probe.log" "$LOGS/wgrad_probe_ep1.log"
    for r in 1 5; do
      step "bench_16k_r$r" 240 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 \
        --out "$LOGS/bench_16k_r$r.json" $([ $r = 1 ] && echo --profile-dir "$LOGS")
      tail -3 "$LOGS/bench_16k_r$r.log"
    done ;;
  final)  # GPU tests, then the benchmark record: fp8 (one GPU), 30B EP=2 both transports, back-to-back, 235B
    CUDA_VISIBLE_DEVICES=0 step pytest_gpu 240 python -m pytest -q -m gpu tests &
    CUDA_VISIBLE_DEVICES=1 step fp8_bench 300 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --backends mega_moe --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8.json" --profile-dir "$LOGS"
    wait
    tail -3 "$LOGS/pytest_gpu.log"; tail -4 "$LOGS/fp8_bench.log"
    step pytest_multigpu 300 python -m pytest -q -m multigpu tests
    tail -3 "$LOGS/pytest_multigpu.log"
    step bench_30b 420 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
      --transports symmetric_memory collectives --iters 10 --warmup 3 --out "$LOGS/bench_30b.json" --profile-dir "$LOGS"
    tail -8 "$LOGS/bench_30b.log"
    step bench_30b_r5 200 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
      --transports symmetric_memory --backends mega_moe --repeat 5 --iters 10 --warmup 3 --out "$LOGS/bench_30b_r5.json"
    tail -3 "$LOGS/bench_30b_r5.log" ;;
  record)  # GPU tests (both GPUs), Qwen3-235B-A22B EP=2, the tiny trainer with default autotuning
    step pytest_gpu 420 python -m pytest -q -m "gpu or multigpu" tests/test_fp8_experts.py tests/test_mega_moe_gpu.py \
      tests/test_mega_moe_ep_gpu.py
    tail -4 "$LOGS/pytest_gpu.log"
    step bench_235b 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 4096 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -5 "$LOGS/bench_235b.log"
    step train_tiny 200 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl" ;;
  last)  # half-tile programs checked on the GPU, fp8 (GPU 1) beside them, then the 30B EP=2 record
    CUDA_VISIBLE_DEVICES=0 step pytest_gpu 200 python -m pytest -q tests/test_tile_blocks.py tests/test_fp8_experts.py tests/test_mega_moe_gpu.py \
      -k "half_tile or gpu" -rA &
    CUDA_VISIBLE_DEVICES=1 step fp8_bench 220 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --backends torch mega_moe --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8.json" \
      --profile-dir "$LOGS"
    wait
    tail -8 "$LOGS/pytest_gpu.log"; tail -4 "$LOGS/fp8_bench.log"
    step bench_30b 200 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
      --transports symmetric_memory collectives --iters 10 --warmup 3 --out "$LOGS/bench_30b.json" --profile-dir "$LOGS" \
      --profile-backends mega_moe
    tail -8 "$LOGS/bench_30b.log"
    step bench_30b_r5 100 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 16384 \
      --transports symmetric_memory --backends mega_moe --repeat 5 --iters 10 --warmup 3 --out "$LOGS/bench_30b_r5.json"
    tail -3 "$LOGS/bench_30b_r5.log" ;;
  split)  # the SwiGLU backward split vs fused (GPU 0) beside the one-GPU tests (GPU 1); EP check; one-call timelines;
          # 30B EP=2 T=16384 one call and back to back; host profile
    CUDA_VISIBLE_DEVICES=0 step dswiglu_probe 240 python scripts/dswiglu_probe.py &
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q \
      tests/test_mega_moe_gpu.py tests/test_tile_blocks.py -rA &
    wait
    cat "$LOGS/dswiglu_probe.log"; tail -4 "$LOGS/pytest_gpu.log"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 150 torchrun --nproc-per-node 2 gpu_check_ep.py)
    for r in 1 5; do
      step "bench_16k_r$r" 240 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 \
        --out "$LOGS/bench_16k_r$r.json" $([ $r = 1 ] && echo --profile-dir "$LOGS" --profile-backends mega_moe)
      tail -3 "$LOGS/bench_16k_r$r.log"
    done
    step timeline_fwd 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    tail -2 "$LOGS/timeline_fwd.log"
    step timeline_bwd 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_bwd"
    tail -2 "$LOGS/timeline_bwd.log"
    step host_overhead 120 torchrun --nproc-per-node 2 scripts/host_overhead.py
    head -30 "$LOGS/host_overhead.log" ;;
  direct)  # compiled-kernel launches: GPU tests (GPU 1) beside the wgrad probe (GPU 0); EP check; 30B EP=2 record
           # with the torch backend; back to back; one-call timeline; host profile
    CUDA_VISIBLE_DEVICES=0 step wgrad_probe 200 python scripts/wgrad_probe.py --segments 2 &
    CUDA_VISIBLE_DEVICES=1 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py tests/test_tile_blocks.py -rA &
    wait
    cat "$LOGS/wgrad_probe.log"; tail -6 "$LOGS/pytest_gpu.log"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 150 torchrun --nproc-per-node 2 gpu_check_ep.py)
    record30 300
    step timeline_fwd 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    tail -1 "$LOGS/timeline_fwd.log"
    step host_overhead 100 torchrun --nproc-per-node 2 scripts/host_overhead.py --calls 50
    head -30 "$LOGS/host_overhead.log" ;;
  launch_ab)  # host time and one-call timings with and without compiled-kernel launches (same machine), fp8 tests and
              # timings (one GPU each), Qwen3-235B-A22B EP=2, the tiny trainer
    for d in 1 0; do
      PRIME_MEGAMOE_DIRECT_LAUNCH=$d step "host_fwd_d$d" 90 torchrun --nproc-per-node 2 scripts/host_overhead.py \
        --no-profile --calls 20
      PRIME_MEGAMOE_DIRECT_LAUNCH=$d step "host_grad_d$d" 90 torchrun --nproc-per-node 2 scripts/host_overhead.py \
        --grad --no-profile --calls 20
      PRIME_MEGAMOE_DIRECT_LAUNCH=$d step "bench_d$d" 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench \
        --shape qwen3-30b-a3b --tokens 16384 --transports symmetric_memory --backends mega_moe --iters 20 --warmup 3 \
        --out "$LOGS/bench_d$d.json"
      grep -h "host ms" "$LOGS/host_fwd_d$d.log" "$LOGS/host_grad_d$d.log"; tail -1 "$LOGS/bench_d$d.log"
    done
    CUDA_VISIBLE_DEVICES=1 step pytest_fp8 200 python -m pytest -q tests/test_fp8_experts.py -rA &
    CUDA_VISIBLE_DEVICES=0 step fp8_bench 200 python -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --backends torch mega_moe --precisions fp8 fp8_bwd --iters 5 --warmup 2 --out "$LOGS/fp8.json"
    wait
    tail -3 "$LOGS/pytest_fp8.log"; tail -4 "$LOGS/fp8_bench.log"
    step bench_235b 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 4096 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -5 "$LOGS/bench_235b.log"
    step train_tiny 150 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    tail -3 "$LOGS/train_tiny.log"; cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl" ;;
  events)  # one-call timelines from launch events (forward, forward + backward), 30B EP=2 T=16384
    timelines ;;
  s4record)  # GPU tests (one GPU, then both), the 30B EP=2 record with the torch backend, back to back, one-call
             # timelines from launch events
    CUDA_VISIBLE_DEVICES=1 step pytest_gpu 200 python -m pytest -q tests/test_mega_moe_gpu.py tests/test_tile_blocks.py \
      tests/test_fp8_experts.py -k "gpu or half_tile" -rA
    tail -12 "$LOGS/pytest_gpu.log"
    step pytest_multigpu 200 python -m pytest -q -m multigpu tests -rA
    tail -4 "$LOGS/pytest_multigpu.log"
    record30 240
    timelines ;;
  ownfirst)  # the own block planned before the peers' routing: EP check, 30B EP=2 T=16384 one call and back to back,
             # one-call timeline
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 100 torchrun --nproc-per-node 2 gpu_check_ep.py)
    for r in 1 5; do
      step "bench_16k_r$r" 80 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 --out "$LOGS/bench_16k_r$r.json"
      tail -1 "$LOGS/bench_16k_r$r.log"
    done
    step timeline_fwd 60 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    grep -h "call:\|fc1_swiglu" "$LOGS"/timeline_fwd.rank0.txt | head -4 ;;
  costs)  # wgrad probe (GPU 0) beside the fp8 GPU tests (GPU 1); host cost of the layer's pieces; host profile
    CUDA_VISIBLE_DEVICES=0 step wgrad_probe 200 python scripts/wgrad_probe.py --segments 2 &
    CUDA_VISIBLE_DEVICES=1 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py -k "gpu or half_tile" -rA &
    wait
    cat "$LOGS/wgrad_probe.log"; tail -4 "$LOGS/pytest_fp8.log"
    CUDA_VISIBLE_DEVICES=0 step host_costs 60 python scripts/host_costs.py
    cat "$LOGS/host_costs.log"
    step host_overhead 90 torchrun --nproc-per-node 2 scripts/host_overhead.py --calls 50
    head -45 "$LOGS/host_overhead.log" | tail -38 ;;
  sections)  # host time per step of one call (forward, then forward + backward), 30B EP=2 T=16384
    step sections_fwd 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --out "$LOGS/sections_fwd"
    step sections_grad 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --grad \
      --out "$LOGS/sections_grad"
    cat "$LOGS/sections_fwd.rank0.txt" | tail -45; grep -h "call:" "$LOGS"/sections_*.txt ;;
  host)  # after host-time cuts: one-GPU tests (GPU 1) beside the EP check... then 30B EP=2 T=16384 one call and back
         # to back, host sections of one forward
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py \
      tests/test_tile_blocks.py -rA
    tail -5 "$LOGS/pytest_gpu.log"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL" "$LOGS/ep_check.log" | head -6
    for run in 1a 5 1b; do
      step "bench_16k_r$run" 200 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat ${run%[ab]} --iters 10 --warmup 3 \
        --out "$LOGS/bench_16k_r$run.json"
      tail -1 "$LOGS/bench_16k_r$run.log"
    done
    step sections_fwd 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --out "$LOGS/sections_fwd"
    tail -42 "$LOGS/sections_fwd.rank0.txt"; grep -h "call:" "$LOGS"/sections_*.txt ;;
  s5final)  # EP check (both transports, bitwise), the 30B EP=2 record with the torch backend (profiled) and back to
            # back, host sections of one forward
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    record30 300
    step sections_fwd 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --out "$LOGS/sections_fwd"
    tail -42 "$LOGS/sections_fwd.rank0.txt"; grep -h "call:" "$LOGS"/sections_*.txt ;;
  routing)  # own routing read in place: EP check (both transports, bitwise), 30B EP=2 T=16384 one call and back to
            # back, host sections of one forward
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    for run in 1 5; do
      step "bench_16k_r$run" 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 4096 \
        16384 --transports symmetric_memory --backends mega_moe --repeat $run --iters 10 --warmup 3 \
        --out "$LOGS/bench_16k_r$run.json"
      tail -2 "$LOGS/bench_16k_r$run.log"
    done
    step sections_fwd 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --out "$LOGS/sections_fwd"
    tail -42 "$LOGS/sections_fwd.rank0.txt" | head -12; grep -h "call:" "$LOGS"/sections_*.txt ;;
  pull)  # peers' blocks pulled at first use: EP check (both transports), 30B EP=2 T=16384 one call, its timeline
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "bitwise" "$LOGS/ep_check.log" | head -3
    step bench_16k_r1 70 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --transports symmetric_memory --backends mega_moe --iters 10 --warmup 3 --out "$LOGS/bench_16k_r1.json"
    tail -1 "$LOGS/bench_16k_r1.log" ;;
  s6ab)  # GPU tests (one GPU each: bf16 + validation, fp8), EP check, then 30B EP=2 T=16384 one call and back to back,
         # this tree against the tree in ab_base/ (git archive of the base commit) on the same machine, alternating
    gpu_tests
    ab16k ;;
  s6plan)  # the reused forward plan: one-GPU tests and EP check, this tree against ab_base/ (alternating, one call
           # and back to back), host sections of one forward and of forward + backward
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py \
      tests/test_tile_blocks.py -rA
    tail -2 "$LOGS/pytest_gpu.log"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k
    step sections_fwd 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --out "$LOGS/sections_fwd"
    step sections_grad 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --grad \
      --out "$LOGS/sections_grad"
    head -34 "$LOGS/sections_fwd.rank0.txt"; grep -h "call:" "$LOGS"/sections_*.txt ;;
  s6final)  # GPU tests (one GPU each: bf16, fp8), EP check, the 30B EP=2 record with the torch backend (profiled)
            # and back to back, the autotuning results they produced
    gpu_tests
    touch /tmp/autotune_marker
    record30 300
    mkdir -p "$LOGS/autotune"; i=0  # every autotuning result of this run (the candidates' timings)
    for f in $(find "$TRITON_CACHE_DIR" -name "*.autotune.json" -newer /tmp/autotune_marker); do
      i=$((i + 1)); cp "$f" "$LOGS/autotune/${i}_$(basename "$f")"
    done ;;
  s6more)  # the tiny trainer on two GPUs (many layers on one reused plan, checkpointed), Qwen3-235B-A22B EP=2 T=16384
    step train_tiny 150 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    tail -3 "$LOGS/train_tiny.log"; cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl"
    step bench_235b 200 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -3 "$LOGS/bench_235b.log" ;;
  s6prio)  # the high-priority side stream and the backward's early exchange: EP check, 30B EP=2 T=16384 one call and
           # back to back
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    for r in 1 5; do
      step "bench_16k_r$r" 90 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 --out "$LOGS/bench_16k_r$r.json"
      tail -1 "$LOGS/bench_16k_r$r.log"
    done ;;
  s7probe)  # weight-gradient variants at an EP=2 rank's rows (GPU 0), then a profiled 30B EP=2 T=16384 run of this
            # tree (one call) and its stage timeline
    step wgrad_variants 300 env CUDA_VISIBLE_DEVICES=0 python scripts/wgrad_variants.py --shape qwen3-30b-a3b \
      --tokens 16384 --segments 2 --experts 64
    sed -n '/best per case/,$p' "$LOGS/wgrad_variants.log"
    step bench_16k_prof 200 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --transports symmetric_memory --backends mega_moe --iters 10 --warmup 3 --out "$LOGS/bench_16k.json" \
      --profile-dir "$LOGS"
    tail -2 "$LOGS/bench_16k_prof.log"
    for t in "$LOGS"/*symmetric_memory*.trace.json.gz; do python scripts/trace_stages.py "$t" > "$LOGS/stages.txt"; done
    tail -4 "$LOGS/stages.txt" ;;
  s7wgrad)  # the weight gradients' TMA / flat-loop kernel: one-GPU tests (GPU 1) beside the wgrad probe at an EP=2
            # rank's rows (GPU 0), the EP check, then this tree against ab_base/ (30B EP=2 T=16384, alternating)
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py \
      tests/test_tile_blocks.py tests/test_validation.py -rA &
    CUDA_VISIBLE_DEVICES=0 step wgrad_probe 300 python scripts/wgrad_probe.py --segments 2 --experts 64 &
    wait
    tail -2 "$LOGS/pytest_gpu.log"; sed -n '/^best/,$p' "$LOGS/wgrad_probe.log"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k ;;
  s7tma)  # TMA reads in the grouped GEMM too: one-GPU tests (GPU 1) beside the grouped-GEMM TMA probe (GPU 0), the
          # EP check, then this tree against ab_base/ (30B EP=2 T=16384, alternating)
    CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q tests/test_mega_moe_gpu.py \
      tests/test_tile_blocks.py tests/test_validation.py -rA &
    CUDA_VISIBLE_DEVICES=0 step gemm_probe 300 python scripts/gemm_tma_probe.py --experts 64 &
    wait
    tail -2 "$LOGS/pytest_gpu.log"; sed -n '/^best/,$p' "$LOGS/gemm_probe.log"; echo "rows where the paths differ: $(grep -c " False$" "$LOGS/gemm_probe.log")"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k ;;
  s7final)  # the record at the session's final code: 30B EP=2 (torch, both transports, T=4096/16384, profiled; back to
            # back), the EP check, Qwen3-235B-A22B EP=2 T=16384
    record30 300
    for t in "$LOGS"/*T16384*symmetric_memory*.trace.json.gz; do python scripts/trace_stages.py "$t" > "$LOGS/stages.txt"; done
    tail -3 "$LOGS/stages.txt"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    step bench_235b 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -3 "$LOGS/bench_235b.log" ;;
  s7timeline)  # one forward + backward call's timeline (host issue vs stream reach, 30B EP=2 T=16384), then the tiny
              # trainer on two GPUs (weight gradients and grouped GEMMs autotuned in the run, with TMA reads)
    step timeline_grad 150 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_grad"
    grep -h "call:" "$LOGS"/timeline_grad*.txt
    step train_tiny 150 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    tail -3 "$LOGS/train_tiny.log"; cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl" ;;
  s7lease)  # forward plans leased from a pool (no per-call clone): the EP check, then 30B EP=2 one call (T=4096 and
            # 16384), back to back, one call again
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    for run in r1a r5 r1b; do
      r=${run#r}; r=${r%[ab]}; tokens="16384"; [ "$run" = r1a ] && tokens="4096 16384"
      step "bench_$run" 100 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens $tokens \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 --out "$LOGS/bench_$run.json"
      tail -2 "$LOGS/bench_$run.log"
    done ;;
  s8record)  # the record at a new session's starting code: 30B EP=2 (torch, both transports, T=4096/16384, profiled;
             # back to back), its stage timeline, the EP check
    record30 300
    for t in "$LOGS"/*T16384*symmetric_memory*.trace.json.gz; do python scripts/trace_stages.py "$t" > "$LOGS/stages.txt"; done
    tail -3 "$LOGS/stages.txt"
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6 ;;
  s8timeline)  # where one forward + backward loses GPU time: the machine's CPUs, one-call and back-to-back timelines
               # from launch events (30B EP=2 T=16384), host time per step of one forward + backward
    (nproc; lscpu | grep -i "numa\|model name\|socket"; cat /sys/fs/cgroup/cpu.max 2>/dev/null; nvidia-smi topo -m) \
      > "$LOGS/cpus.txt" 2>&1; cat "$LOGS/cpus.txt"
    step timeline_grad 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_grad"
    step timeline_grad_r5 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --repeat 5 \
      --out "$LOGS/timeline_grad_r5"
    step sections_grad 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --grad \
      --out "$LOGS/sections_grad"
    grep -h "call:" "$LOGS"/timeline_grad*.txt "$LOGS"/sections_grad*.txt ;;
  s8pull)  # the backward's pull after its first GEMMs: the EP check (both transports, bitwise), this tree against
           # ab_base/ (30B EP=2 T=16384, alternating one call / back to back), host time per step of forward + backward
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k
    step sections_grad 90 torchrun --nproc-per-node 2 scripts/call_timeline.py --host-sections --grad \
      --out "$LOGS/sections_grad"
    grep -h "call:" "$LOGS"/sections_grad*.txt ;;
  s8memop)  # flags set by stream write-value operations, the backward's exchange after its first GEMMs: the EP check
            # (both transports, bitwise), the missing-peer timeout, this tree against ab_base/ (30B EP=2 T=16384,
            # alternating), one forward + backward call's timeline
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    (cd scripts && step timeout_check 90 torchrun --nproc-per-node 2 gpu_check_timeout.py)
    tail -3 "$LOGS/timeout_check.log"
    ab16k
    step timeline_grad 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_grad"
    grep -h "call:" "$LOGS"/timeline_grad*.txt ;;
  s8final)  # the forward's exchange between its first FC1 and FC2: the EP check, this tree against ab_base/ (30B EP=2
            # T=16384, alternating), then the record: 30B EP=2 (torch, both transports, T=4096/16384, profiled; back to
            # back) and its stage timeline
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k
    record30 300
    for t in "$LOGS"/*T16384*symmetric_memory*.trace.json.gz; do python scripts/trace_stages.py "$t" > "$LOGS/stages.txt"; done
    tail -3 "$LOGS/stages.txt" ;;
  s9profile)  # where a single call's host time goes before its first GEMM: host time to the first FC1 launch of
              # single forward + backward calls, and a cProfile of them by own time (this session's run used
              # scripts/host_profile.py of e66fc24, since folded into host_overhead.py and host_costs.py)
    step host_first_fc1 100 torchrun --nproc-per-node 2 scripts/host_overhead.py --grad --no-profile --calls 20
    grep -h "single calls" "$LOGS/host_first_fc1.log"
    step host_profile 100 torchrun --nproc-per-node 2 scripts/host_overhead.py --grad --sort tottime --calls 20
    grep -h "host ms" "$LOGS/host_profile.log" ;;
  s9split)  # what the one-call backward figure is made of: the benchmark's forward with autograd and forward +
            # backward (one call, back to back), and one-call timelines of each
    for r in 1 5 1; do
      step bench_r$r 150 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
        --transports symmetric_memory --backends mega_moe --repeat $r --iters 10 --warmup 3 --out "$LOGS/bench_r$r.json"
      python -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print({k: r[k] for k in ('forward_ms', 'forward_grad_ms', 'forward_backward_ms', 'backward_ms')})" "$LOGS/bench_r$r.json"
      mv "$LOGS/bench_r$r.json" "$LOGS/bench_r${r}_$(date +%s).json"
    done
    step timeline_fwdgrad 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --forward-grad --out "$LOGS/timeline_fwdgrad"
    step timeline_grad 120 torchrun --nproc-per-node 2 scripts/call_timeline.py --grad --out "$LOGS/timeline_grad"
    grep -h "call:" "$LOGS"/timeline_*.txt ;;
  s9wgrad)  # the weight gradient's last step moved back inside its pipelined loop: wgrad_probe in this tree and in
            # ab_base/ (each GPU runs both, in opposite orders), the EP check, then this tree against ab_base/ (30B EP=2
            # T=16384, alternating one call / back to back)
    (CUDA_VISIBLE_DEVICES=0 step probe_new0 150 python scripts/wgrad_probe.py --segments 2 --experts 64
     cd ab_base && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$PWD step probe_base0 150 python scripts/wgrad_probe.py \
       --segments 2 --experts 64) &
    (cd ab_base && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site:$PWD step probe_base1 150 python scripts/wgrad_probe.py \
       --segments 2 --experts 64
     cd .. && CUDA_VISIBLE_DEVICES=1 step probe_new1 150 python scripts/wgrad_probe.py --segments 2 --experts 64) &
    wait
    for f in probe_new0 probe_base0 probe_base1 probe_new1; do echo "== $f"; grep "tma" "$LOGS/$f.log" | sed "s/'GROUP_M': 8}//"; done
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k ;;
  s9publish)  # the own fill writes the published routing (no SM-bound kernel left in the publish), the own copy after
              # the peers': the two-GPU tests (the EP check, a missing peer), this tree against ab_base/ (30B EP=2 T=16384,
              # alternating), one-call timelines of the no-grad forward
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ep_gpu 150 python -m pytest -q tests/test_mega_moe_ep_gpu.py -rA
    tail -3 "$LOGS/pytest_ep_gpu.log"
    ab16k
    step timeline_fwd 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    grep -h "call:" "$LOGS"/timeline_fwd*.txt ;;
  s9final)  # the session's final code: every weight-gradient candidate on each GPU, the EP check (both transports,
            # bitwise), the record (30B EP=2, torch, both transports, T=4096/16384, profiled; back to back) and its
            # stage timeline, configs/tiny.toml on two GPUs
    (CUDA_VISIBLE_DEVICES=0 step probe_final0 150 python scripts/wgrad_probe.py --segments 2 --experts 64) &
    (CUDA_VISIBLE_DEVICES=1 step probe_final1 150 python scripts/wgrad_probe.py --segments 2 --experts 64) &
    wait
    for f in probe_final0 probe_final1; do echo "== $f"; grep -A3 "^best" "$LOGS/$f.log"; done
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    record30 300
    for t in "$LOGS"/*T16384*symmetric_memory*.trace.json.gz; do python scripts/trace_stages.py "$t" > "$LOGS/stages.txt"; done
    tail -3 "$LOGS/stages.txt"
    step train_tiny 150 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    tail -3 "$LOGS/train_tiny.log"; cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl" ;;
  s9spare)  # persistent FC1 / FC2 leave one SM for the side stream's wait kernel: the EP check, this tree against
            # ab_base/ (30B EP=2 T=16384, alternating), a one-call timeline of the no-grad forward, then the record
            # (30B EP=2, torch, both transports, T=4096/16384, profiled; back to back)
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 90 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    ab16k
    step timeline_fwd 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    grep -h "call:" "$LOGS"/timeline_fwd*.txt
    record30 200 ;;
  s9b235)  # Qwen3-235B-A22B EP=2 T=16384 at the final package: torch and mega_moe over symmetric memory
    step bench_235b 175 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -4 "$LOGS/bench_235b.log" ;;
  s10push)  # blocks pushed into the peers' inboxes (no local copy, no pull): the two-GPU tests (the EP check with a
            # layer stack, a missing peer), this tree against ab_base/ (30B EP=2 T=16384, alternating), a one-call
            # timeline of the no-grad forward
    PRIME_MEGAMOE_AUTOTUNE=0 step pytest_ep_gpu 200 python -m pytest -q tests/test_mega_moe_ep_gpu.py -rA
    tail -3 "$LOGS/pytest_ep_gpu.log"
    ab16k
    step timeline_fwd 100 torchrun --nproc-per-node 2 scripts/call_timeline.py --out "$LOGS/timeline_fwd"
    grep -h "call:" "$LOGS"/timeline_fwd*.txt ;;
  s10record)  # the record at the push transport (30B EP=2, torch, both transports, T=4096/16384, profiled; back to
              # back), then Qwen3-235B-A22B EP=2 T=16384 (torch and mega_moe over symmetric memory)
    record30 200
    step bench_235b 175 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-235b-a22b --tokens 16384 \
      --transports symmetric_memory --iters 5 --warmup 2 --out "$LOGS/bench_235b.json"
    tail -4 "$LOGS/bench_235b.log" ;;
  s10final)  # the session's final package on a fresh machine: the one-GPU tests and the EP check (gpu_tests),
             # configs/tiny.toml on two GPUs, the record (30B EP=2, torch, both transports, T=4096/16384, profiled;
             # back to back)
    gpu_tests
    step train_tiny 150 torchrun --nproc-per-node 2 -m prime_megamoe.train configs/tiny.toml --train.steps 10 \
      --output-dir /tmp/tiny
    tail -3 "$LOGS/train_tiny.log"; cp /tmp/tiny/metrics.jsonl "$LOGS/metrics_tiny.jsonl"
    record30 200 ;;
  s10trim)  # fewer Python steps on the host path (Stream objects, device strings, an allocation before the first
            # FC1): the EP check, host time to the first FC1 launch in single forwards (this tree, then ab_base/),
            # this tree against ab_base/ (30B EP=2 T=16384, alternating), then the record
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -6
    step host_new 100 torchrun --nproc-per-node 2 scripts/host_overhead.py --no-profile --calls 20
    (cd ab_base && PYTHONPATH=/tmp/site:$PWD step host_base 100 torchrun --nproc-per-node 2 scripts/host_overhead.py \
      --no-profile --calls 20)
    grep -h "single calls" "$LOGS"/host_*.log
    ab16k
    record30 200 ;;
  s11probe)  # fp8 (one GPU each): every fp8 kernel candidate timed (GPU 0) beside the quantised precisions' GPU tests,
             # then fp8 / fp8_bwd at T=16384 for this tree (with torch) and ab_base/ (GPU 1)
    CUDA_VISIBLE_DEVICES=0 step fp8_probe 420 python scripts/fp8_probe.py &
    (
      CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
        -k "gpu or half_tile" -rA
      tail -2 "$LOGS/pytest_fp8.log"
      fp8bench new 240 --backends torch mega_moe
      fp8bench base 200 --backends mega_moe
    )
    wait
    cat "$LOGS/fp8_probe.log" ;;
  s11b)  # scalar weight scales and scales loaded a step ahead in the fp8 GEMMs, the SwiGLU pass per (tile, column
         # block): the quantised precisions' GPU tests (GPU 0) beside every fp8 kernel candidate (GPU 1), then fp8 /
         # fp8_bwd at T=16384 for this tree and ab_base/ (GPU 1, one after the other)
    CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
      -k "gpu or half_tile" -rA &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe 420 python scripts/fp8_probe.py
    wait
    tail -2 "$LOGS/pytest_fp8.log"
    fp8bench new 240 --backends torch mega_moe
    fp8bench base 200 --backends mega_moe
    cat "$LOGS/fp8_probe.log" ;;
  s11c)  # the SwiGLU pass in one or two launches, pruned fp8 candidates, compiled-kernel launches in the fp8 path: the
         # GPU tests (quantised precisions, half-tile programs; GPU 0) beside every fp8 kernel candidate (GPU 1); fp8 /
         # fp8_bwd at T=16384, this tree and ab_base/ (GPU 1); then EP=2 over collectives with torch (both GPUs)
    (
      CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
        tests/test_tile_blocks.py -k "gpu or half_tile or one_dot" -rA
      tail -2 "$LOGS/pytest_fp8.log"
    ) &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe 420 python scripts/fp8_probe.py
    wait
    fp8bench new 200 --backends mega_moe
    fp8bench base 200 --backends mega_moe
    step fp8_ep2 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --transports collectives --iters 5 --warmup 2 --out "$LOGS/fp8_ep2.json"
    tail -5 "$LOGS/fp8_ep2.log"
    cat "$LOGS/fp8_probe.log" ;;
  s11d)  # TMA reads in the fp8 FC1 / grouped GEMM: the GPU tests (quantised precisions, half tiles, TMA against
         # pointers; GPU 0) beside every fp8 kernel candidate with and without TMA (GPU 1); fp8 / fp8_bwd at T=16384,
         # this tree with torch, then ab_base/ (GPU 1); EP=2 over collectives (both GPUs)
    (
      CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
        -k "gpu or half_tile or tma" -rA
      tail -2 "$LOGS/pytest_fp8.log"
    ) &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe 420 python scripts/fp8_probe.py
    wait
    fp8bench new 200 --backends torch mega_moe
    fp8bench base 200 --backends mega_moe
    step fp8_ep2 300 torchrun --nproc-per-node 2 -m prime_megamoe.bench --shape qwen3-30b-a3b --tokens 16384 \
      --precisions fp8 fp8_bwd --transports collectives --backends mega_moe --iters 5 --warmup 2 \
      --out "$LOGS/fp8_ep2.json"
    tail -3 "$LOGS/fp8_ep2.log"
    cat "$LOGS/fp8_probe.log" ;;
  s11e)  # TMA reads in the fp8 weight gradients, FC1 back on pointer loads: the quantised precisions' and the one-GPU
         # bf16 tests (GPU 0) beside every fp8 kernel candidate with and without TMA (GPU 1); the EP check (both
         # GPUs); fp8 / fp8_bwd at T=16384 with torch, one call and back to back (GPU 1); EP=2 over collectives
    (
      CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 240 python -m pytest -q tests/test_fp8_experts.py \
        -k "gpu or half_tile or tma" -rA
      tail -2 "$LOGS/pytest_fp8.log"
      CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 240 python -m pytest -q \
        tests/test_mega_moe_gpu.py tests/test_tile_blocks.py tests/test_validation.py -rA
      tail -2 "$LOGS/pytest_gpu.log"
    ) &
    CUDA_VISIBLE_DEVICES=1 step fp8_probe 420 python scripts/fp8_probe.py
    wait
    (cd scripts && PRIME_MEGAMOE_AUTOTUNE=0 step ep_check 120 torchrun --nproc-per-node 2 gpu_check_ep.py)
    grep -h "PASS\|FAIL\|Error" "$LOGS/ep_check.log" | head -9
    fp8record
    cat "$LOGS/fp8_probe.log" ;;
  s11f)  # the final fp8 package again on another machine: fp8 / fp8_bwd at T=16384 with torch, one call and back to
         # back (GPU 1); EP=2 over collectives (both GPUs)
    fp8record ;;
  s11g)  # one shared helper for both SwiGLU backward passes: the bf16 pass timed (dswiglu_probe) and the quantised
         # precisions' GPU tests (GPU 1) beside the one-GPU bf16 tests (GPU 0)
    CUDA_VISIBLE_DEVICES=0 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_gpu 200 python -m pytest -q tests/test_mega_moe_gpu.py \
      tests/test_tile_blocks.py tests/test_validation.py -rA &
    (
      CUDA_VISIBLE_DEVICES=1 step dswiglu_probe 100 python scripts/dswiglu_probe.py
      CUDA_VISIBLE_DEVICES=1 PRIME_MEGAMOE_AUTOTUNE=0 step pytest_fp8 200 python -m pytest -q \
        tests/test_fp8_experts.py -k "gpu or half_tile or tma" -rA
    )
    wait
    cat "$LOGS/dswiglu_probe.log"; tail -n 1 "$LOGS/pytest_gpu.log" "$LOGS/pytest_fp8.log" ;;
  *) echo "usage: $0 check|bench|train|probe|pipeline|final|record|last|split|direct|launch_ab|events|s4record|ownfirst|pull|s6ab|s6plan|s6final|s6more|s6prio|s7probe|s7wgrad|s7tma|s7final|s7timeline|s7lease|s8record|s8timeline|s8pull|s8memop|s8final|s9profile|s9split|s9wgrad|s9publish|s9final|s9spare|s9b235|s10push|s10record|s10final|s10trim|s11probe|s11b|s11c|s11d|s11e|s11f|s11g" >&2
     exit 2 ;;
esac
