#!/usr/bin/env bash
# The whole one-GPU test set in four parts, one device call each (a call runs at most 600 s; the
# DeepSeek V4 files alone took more than 330 s on an H200 on 2026-12-05). Each part prints pytest's
# tail and its 15 slowest tests (`--durations`), so the parts can be rebalanced from the record.
# The tensor-parallel tests need two GPUs: `tests/test_tensor_parallel_gpu.py` on nvidia-h200-x2.
#   part 1: the attention kernels (Triton and Gluon), mixed-step graphs, cascade and work-list decode
#   part 2: DeepSeek V4's kernels and its Gluon sparse decode (with the graph and engine files as
#           well it ran past 330 s on an H100 on 2026-12-06, once the two-part kernel's tests came; 203 s before)
#   part 3: DeepSeek V4's graphs, its engine on the GPU, fused ops, MoE and whole-engine tests
#           (graphs and engine: 50 s on that H100; the rest 24 s on 2026-12-05)
#   part 4: the runner's host paths (batch tables, staging, wait mode), the engine, prompt logprobs, sweep
# Usage (GPU machine, repo root): [SUITE_SECONDS=560] bash benchmarks/gpu_suite.sh 1|2|3|4 [pytest args]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:?usage: gpu_suite.sh 1|2|3|4 [pytest args]}; shift
case $part in
  1) files="tests/test_triton_kernels.py tests/test_prefill_gluon.py tests/test_mixed_graphs.py
            tests/test_cascade_attention.py tests/test_decode_work.py tests/test_attention_ref.py
            tests/test_attention_warmup.py" ;;
  2) files="tests/test_v4_sparse_gluon.py tests/test_deepseek_v4_kernels.py" ;;
  3) files="tests/test_deepseek_v4_graphs.py tests/test_deepseek_v4_gpu.py tests/test_deepseek_v4_fused.py
            tests/test_deepseek_v4_moe.py tests/test_deepseek_v4_engine.py tests/test_v4_launch_variants.py" ;;
  4) files="tests/test_batch_tables.py tests/test_gpu_engine.py tests/test_prompt_logprobs.py tests/test_fused_ops.py
            tests/test_cuda_wait.py tests/test_sweep.py" ;;
  *) echo "part must be 1, 2, 3 or 4, got $part" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,uuid,clocks.sm,temperature.gpu --format=csv,noheader
# -m gpu: the parts time the GPU tests; the CPU tests of these files run in CI
timeout ${SUITE_SECONDS:-560} python3 -m pytest -q -m gpu --durations=15 $files "$@" 2>&1 | tail -40 | tee "$OUT/gpu_suite_$part.txt"
