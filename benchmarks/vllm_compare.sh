#!/usr/bin/env bash
# The serving comparison with vLLM 0.26.0 in one device lease, three calls back to back (the
# vLLM bundle needs three calls to travel, ../shared/peers/vllm/README.md), each doing work
# while the next part of the bundle waits:
#   stage 1  carry [".vp1"]:                              the single-GPU test suite
#   stage 2  carry [".vp2", ".srv", ".dummy-qwen3-8b"]:   kvserve's serving runs; unpack vLLM
#   stage 3  carry [".vp3", ".dummy-qwen3-8b"]:           finish vLLM's site; vLLM's serving runs
# .srv holds kvserve's server wheels (fastapi, starlette, uvicorn, pydantic, pydantic-core,
# annotated-types, typing-inspection, opentelemetry-api, msgspec, pyzmq, py-spy; cp312).
# Carry .dummy-qwen3-8b in every call that serves: ignored paths not carried are removed there.
# Usage (GPU machine, repo root): bash benchmarks/vllm_compare.sh 1|2|3 ["WORKLOAD:RATE[:N] ..."]
set -u
stage=${1:?stage} runs=${2:-"ide-completion:30 ide-completion:60 mixed:60:256"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
case $stage in
  1)
    mkdir -p .vsite
    PYTHONPATH=$PWD timeout 500 python3 -m pytest -q -m gpu --ignore tests/test_prompt_logprobs.py \
      --ignore tests/test_tensor_parallel_gpu.py tests 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt" ;;
  2)  # kvserve first, while .vsite is still empty: it must not see vLLM's packages
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .srv/*.whl > /dev/null
    PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH timeout 480 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "$runs"
    cat .vp1/* .vp2/* | xz -d -T8 | tar -x -C .vsite ;;
  3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    export PATH=$PWD/.vsite/bin:$PATH
    timeout 540 bash benchmarks/serve_load.sh vllm "$PWD/.dummy-qwen3-8b" "$runs" ;;
  *) echo "stage must be 1, 2 or 3"; exit 2 ;;
esac
