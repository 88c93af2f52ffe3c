#!/usr/bin/env bash
# One device call: GPU tests, then the anchor throughput and batch-1 latency benches.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh [tests|bench|all|mixed] [extra bench flags]
#   mixed: the attention and mixed-graph GPU tests, decode-only against mixed steps with their kernels
#          (mixed_step_bench.py), and the kernels of a V4 batch-1 decode step (v4_model_bench.py --kernels).
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
if [ "$what" = mixed ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_mixed_graphs.py tests/test_attention_ref.py \
    2>&1 | tail -4 | tee "$OUT/mixed_tests.log"
  timeout 150 python3 benchmarks/mixed_step_bench.py --model dummy:qwen3-8b --device cuda --profile 2>&1 \
    | grep -v "^INFO" | tail -32 | tee "$OUT/mixed_step.txt"
  timeout 150 python3 benchmarks/v4_model_bench.py --kernels 1 4096 2>&1 | tail -24 | tee "$OUT/v4_kernels_b1.txt"
fi
