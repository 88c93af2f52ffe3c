#!/usr/bin/env bash
# One device call: GPU tests, then the anchor throughput and batch-1 latency benches.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh [tests|bench|all|mixed] [extra bench flags]
#   mixed: the attention and mixed-graph GPU tests, decode-only against mixed steps with their kernels
#          (mixed_step_bench.py), and the kernels of a V4 batch-1 decode step (v4_model_bench.py --kernels).
#   host: the GPU tests of the runner's host paths (pending tokens, tables, staging, graphs), then the
#         host step's parts at 256 running, steady and with one finish a step (_lay_out's calls a step
#         show the padded table widths at work).
#   v4path: the Gluon sparse decode kernel's GPU tests, the CSA decode path at 64/256 x 32K/128K, its
#         kernels' default configs (checked), the path as launched and as a CUDA graph's replay, then
#         the Gluon sparse decode probe's variants.
#   topk: the top-k's GPU tests (the group list included), then top_k_probe.py: the production
#         kernel with and without `group_list`, and at 8 and 16 scores a thread per compaction step;
#         then the V4 decode path (v4_kernel_bench.py --path-only) without and with `group_list`, then
#         the rest of the V4 GPU set at the tree's defaults.
#   hostab BASE: host_step_ab.py against BASE's package carried as .base.tar (`git archive BASE kvserve
#         > .base.tar`), steady and with one finish a step.
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
if [ "$what" = host ]; then
  timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_mixed_graphs.py tests/test_prompt_logprobs.py \
    tests/test_batch_tables.py tests/test_fused_ops.py tests/test_decode_work.py tests/test_warm_logits.py \
    2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
  for mode in "" "--finish-per-step 1"; do
    echo "== host_step_bench.py --model dummy:qwen3-8b --device cuda --running 256 --steps 96 --parts --temperature 0 $mode"
    timeout 120 python3 benchmarks/host_step_bench.py --model dummy:qwen3-8b --device cuda --running 256 --steps 96 \
      --parts --temperature 0 $mode 2>&1 | grep -v "^INFO" | tail -24 | tee -a "$OUT/host_parts.txt"
  done
fi
if [ "$what" = hostab ]; then
  base=${1:?usage: gpu_session.sh hostab BASE (with .base.tar carried)}
  for mode in "" "--finish-per-step 1"; do
    echo "== host_step_ab.py --base $base --base-archive .base.tar --dtype float32 --num-kv-blocks 24000 --running 256 --steps 96 --temperature 0 $mode"
    timeout 240 python3 benchmarks/host_step_ab.py --base "$base" --base-archive .base.tar --device cuda --dtype float32 \
      --num-kv-blocks 24000 --running 256 --steps 96 --temperature 0 $mode 2>&1 | grep -A8 "^running=" | tee -a "$OUT/host_ab.txt"
  done
fi
if [ "$what" = mixed ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_mixed_graphs.py tests/test_attention_ref.py \
    2>&1 | tail -4 | tee "$OUT/mixed_tests.log"
  timeout 150 python3 benchmarks/mixed_step_bench.py --model dummy:qwen3-8b --device cuda --profile 2>&1 \
    | grep -v "^INFO" | tail -32 | tee "$OUT/mixed_step.txt"
  timeout 150 python3 benchmarks/v4_model_bench.py --kernels 1 4096 2>&1 | tail -24 | tee "$OUT/v4_kernels_b1.txt"
fi
if [ "$what" = v4path ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_v4_sparse_gluon.py 2>&1 | tail -3 | tee "$OUT/gluon_tests.txt"
  timeout 200 python3 benchmarks/v4_kernel_bench.py --no-extras --path-only --contexts 32768 131072 --batches 64 256 \
    2>&1 | tee "$OUT/v4_path.txt" | grep -v "^| bs=\|^|---\|^| shape" | tail -30
  timeout 120 python3 benchmarks/gluon_sparse_decode_probe.py 2>&1 | tee "$OUT/gluon_probe.txt" | grep "batch"
fi
if [ "$what" = topk ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_deepseek_v4_kernels.py -k top_k 2>&1 | tail -3 | tee "$OUT/topk_tests.txt"
  timeout 150 python3 benchmarks/top_k_probe.py --no-stages --compact-per-thread 8 16 2>&1 | grep -v -i warn \
    | tee "$OUT/top_k_probe.txt"
  for on_off in off on; do
    timeout 120 python3 benchmarks/v4_kernel_bench.py --no-extras --path-only --contexts 32768 131072 --batches 64 256 \
      --top-k-group-list $on_off 2>&1 | tee -a "$OUT/v4_path.txt" | grep -v "^| bs=\|^|---\|^| shape" | tail -24
  done
  timeout 280 python3 -m pytest -q -m gpu tests/test_deepseek_v4_graphs.py tests/test_deepseek_v4_gpu.py \
    tests/test_v4_sparse_gluon.py tests/test_deepseek_v4_kernels.py -k "not top_k" 2>&1 | tail -3 | tee "$OUT/v4_tests.txt"
fi
