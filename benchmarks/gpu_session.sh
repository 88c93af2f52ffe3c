#!/usr/bin/env bash
# One device call: GPU tests, then the anchor throughput and batch-1 latency benches.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh [tests|bench|all] [extra bench flags]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m pytest tests/test_fused_ops.py tests/test_gpu_engine.py tests/test_triton_kernels.py -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
bench() {  # name, flags...
  local name=$1; shift
  echo "== kvserve bench throughput --model dummy:qwen3-8b --max-model-len 4096 --gpu-memory-utilization 0.85 $*"
  KVSERVE_PROFILE=$OUT/profile_$name.txt python3 -m kvserve.cli bench throughput --model dummy:qwen3-8b \
    --max-model-len 4096 --gpu-memory-utilization 0.85 "$@" 2>&1 | grep -v "Processed prompts" | tee "$OUT/$name.log" | tail -9
}
if [ "$what" = bench ] || [ "$what" = all ]; then
  bench throughput --num-prompts 256 --input-len 512 --output-len 128 "$@"
  bench latency --latency "$@"
fi
