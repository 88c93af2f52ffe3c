#!/usr/bin/env bash
# The serving comparison with vLLM 0.26.0 in one device lease, three calls back to back (the
# vLLM bundle needs three calls to travel, ../shared/peers/vllm/README.md), each doing work
# while the next part of the bundle waits:
#   stage 1  carry [".vp1"]:                     the single-GPU test suite
#   stage 2  carry [".vp2"]:                     unpack vLLM; kvserve's step benches (no server)
#   stage 3  carry [".vp3", ".dummy-qwen3-8b"]:  finish vLLM's site; both engines' serving runs
# Both servers take their web packages (fastapi, uvicorn, pydantic, pyzmq, msgspec) from vLLM's
# site: carrying kvserve's own beside .vp2 would pass the 64 MiB a call may carry.
# Carry .dummy-qwen3-8b in every call that serves: ignored paths not carried are removed there.
# kvserve's server writes its step trace to $OUT/steps_kvserve.tsv (kvserve/engine/step_trace.py).
# Usage (GPU machine, repo root): bash benchmarks/vllm_compare.sh 1|2|3 ["WORKLOAD:RATE[:N] ..."]
set -u
stage=${1:?stage} runs=${2:-"ide-completion:30 ide-completion:60 mixed:60:256"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case $stage in
  1)
    mkdir -p .vsite
    PYTHONPATH=$PWD timeout 480 python3 -m pytest -q -m gpu --ignore tests/test_prompt_logprobs.py \
      --ignore tests/test_tensor_parallel_gpu.py tests 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt" ;;
  2)
    cat .vp1/* .vp2/* | xz -d -T8 | tar -x -C .vsite
    export PYTHONPATH=$PWD
    timeout 200 python3 benchmarks/mixed_step_bench.py --model dummy:qwen3-8b --device cuda --running 26 \
      --profile 2>&1 | tee "$OUT/mixed_step_26.txt"
    timeout 240 python3 benchmarks/host_step_bench.py --model dummy:qwen3-8b --device cuda 2>&1 \
      | tail -5 | tee "$OUT/host_step_bench.txt" ;;
  3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    export PATH=$PWD/.vsite/bin:$PATH
    KVSERVE_STEP_TRACE=$OUT/steps_kvserve.tsv timeout 270 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "$runs"
    python3 -m kvserve.engine.step_trace "$OUT/steps_kvserve.tsv" | tee "$OUT/steps_kvserve_summary.txt"
    timeout 300 bash benchmarks/serve_load.sh vllm "$PWD/.dummy-qwen3-8b" "$runs" ;;
  *) echo "stage must be 1, 2 or 3"; exit 2 ;;
esac
