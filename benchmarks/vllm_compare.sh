#!/usr/bin/env bash
# The serving comparison with vLLM 0.26.0 in one device lease, four calls back to back (the
# vLLM bundle needs three calls to travel, ../shared/peers/vllm/README.md; the first two test
# while the next part of the bundle waits):
#   stage 1  carry [".vp1"]:                     the single-GPU tests but DeepSeek V4's
#   stage 2  carry [".vp2"]:                     unpack vLLM; DeepSeek V4's GPU tests
#   stage 3  carry [".vp3", ".dummy-qwen3-8b"]:  finish vLLM's site; kvserve's serving runs
#   stage 4  carry [".dummy-qwen3-8b"]:          vLLM's serving runs (about 150 s of start-up, then
#                                                the runs: more than one call holds with kvserve's)
# Both servers take their web packages (fastapi, uvicorn, pydantic, pyzmq, msgspec) from vLLM's
# site: carrying kvserve's own beside .vp2 would pass the 64 MiB a call may carry.
# Carry .dummy-qwen3-8b in every call that serves: ignored paths not carried are removed there.
# kvserve's server writes its step trace to $OUT/steps_kvserve.tsv (kvserve/engine/step_trace.py).
# Usage (GPU machine, repo root): bash benchmarks/vllm_compare.sh 1|2|3|4 ["WORKLOAD:RATE[:N] ..."]
set -u
stage=${1:?stage} runs=${2:-"ide-completion:30 ide-completion:60 mixed:60:256"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The GPU-marked tests of the given files. Files that import the server's or the tools' packages
# (fastapi, openai: not on the device image) fail to collect; they hold no GPU tests.
gpu_tests() {
  PYTHONPATH=$PWD timeout 500 python3 -m pytest -q -m gpu --continue-on-collection-errors \
    --ignore tests/test_tensor_parallel_gpu.py $1 2>&1 \
    | grep -v "^ERROR tests" | tail -4 | tee "$2"
}
case $stage in
  1)
    mkdir -p .vsite
    gpu_tests "$(ls tests/test_*.py | grep -v deepseek_v4)" "$OUT/gpu_tests_1.txt" ;;
  2)
    cat .vp1/* .vp2/* | xz -d -T8 | tar -x -C .vsite
    gpu_tests "$(ls tests/test_deepseek_v4_*.py)" "$OUT/gpu_tests_2.txt" ;;
  3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    export PATH=$PWD/.vsite/bin:$PATH
    KVSERVE_STEP_TRACE=$OUT/steps_kvserve.tsv timeout 500 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "$runs"
    python3 -m kvserve.engine.step_trace "$OUT/steps_kvserve.tsv" | tee "$OUT/steps_kvserve_summary.txt" ;;
  4)
    export PATH=$PWD/.vsite/bin:$PATH
    timeout 540 bash benchmarks/serve_load.sh vllm "$PWD/.dummy-qwen3-8b" "$runs" ;;
  *) echo "stage must be 1, 2, 3 or 4"; exit 2 ;;
esac
