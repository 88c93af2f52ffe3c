#!/usr/bin/env bash
# The same-device-lease comparison with vLLM 0.26.0 (the KV-pressure workloads, the anchor
# throughput and batch-1 latency), in stages, one device call each, back to back (the machine is
# given back after ~30 s idle). Repo root on the GPU machine.
#   tests          GPU tests
#   vllm-capped    vLLM: code review + IDE under the 65,536-token KV cap (one engine start)
#   vllm-uncapped  vLLM: code review uncapped + anchor throughput + batch-1 latency (one start; W= picks)
#   kvserve        kvserve: the same three runs, plus `kvserve bench throughput` anchor and --latency
#   kvserve-uncapped  kvserve: code review uncapped
#   kvserve-lru    kvserve: code review capped with plain LRU and no host tier (the collapse we fix)
#   kvserve-rotation  kvserve: code review + IDE capped, host tier + reuse + KV rotation every 16 steps
#   rotation-sweep    kvserve: code review capped, host tier + reuse, rotation interval ${N:-0 8 16 32}
# vLLM comes from .vsite (see ../shared/peers/vllm/README.md for carrying it).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
B="python3 benchmarks/kv_pressure_bench.py"
show() { grep -E "batch of|  steps |RESULT|STATS|startup|passed|failed|error|Error|ms/step|tok/s|engine|----|kvserve  " | grep -v "Processed prompts"; }
case ${1:?stage} in
  tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    PYTHONPATH=$PWD timeout 280 python3 -m pytest tests/test_fused_ops.py tests/test_gpu_engine.py tests/test_triton_kernels.py -q 2>&1 | tail -4 ;;
  vllm-capped)
    PYTHONPATH=$PWD/.vsite timeout 590 $B --engine vllm --workload code-review,ide 2>&1 | show ;;
  vllm-uncapped)
    PYTHONPATH=$PWD/.vsite timeout 590 $B --engine vllm --workload ${W:-code-review,anchor,latency} --cap-tokens 0 2>&1 | show ;;
  kvserve)
    export PYTHONPATH=$PWD
    timeout 200 $B --engine kvserve --workload code-review,ide --cpu-kv-cache-gb 16 --eviction-policy reuse --stats 2>&1 | show
    timeout 150 $B --engine kvserve --workload code-review,anchor,latency --cap-tokens 0 2>&1 | show
    for mode in "--num-prompts 256 --input-len 512 --output-len 128" "--latency"; do
      echo "\$ kvserve bench throughput --model dummy:qwen3-8b --max-model-len 4096 --gpu-memory-utilization 0.85 --max-num-batched-tokens 16384 $mode"
      timeout 100 python3 -m kvserve.cli bench throughput --model dummy:qwen3-8b --max-model-len 4096 \
        --gpu-memory-utilization 0.85 --max-num-batched-tokens 16384 $mode 2>&1 | grep -v "Processed prompts" | tail -7
    done ;;
  kvserve-rotation)
    PYTHONPATH=$PWD timeout 200 $B --engine kvserve --workload code-review,ide --cpu-kv-cache-gb 16 \
      --eviction-policy reuse --kv-rotation-interval 16 --stats 2>&1 | show ;;
  rotation-sweep)
    for n in ${N:-0 8 16 32}; do
      echo "== kv-rotation-interval $n"
      PYTHONPATH=$PWD timeout 120 $B --engine kvserve --workload code-review --cpu-kv-cache-gb 16 \
        --eviction-policy reuse --kv-rotation-interval $n --stats ${PROFILE:+--step-profile} 2>&1 | show
    done ;;
  kvserve-uncapped)
    PYTHONPATH=$PWD timeout 150 $B --engine kvserve --workload code-review --cap-tokens 0 --stats 2>&1 | show ;;
  kvserve-lru)
    PYTHONPATH=$PWD timeout 150 $B --engine kvserve --workload code-review --stats 2>&1 | show ;;
esac
