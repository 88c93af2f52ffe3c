#!/usr/bin/env bash
# The serving comparison with vLLM 0.26.0 in one device lease, five calls back to back (the
# vLLM bundle needs three calls to travel, ../shared/peers/vllm/README.md; the first two test
# while the next part of the bundle waits):
#   stage 1  carry [".vp1"]:                     GPU tests of the engine, its graphs and kernels; a
#                                                mixed burst's stalls (step_diagnostics.py mixedburst);
#                                                with PROFILES=1 also prefill attention against cuDNN and
#                                                the TMA path, an 8K eager step's kernels by kind, and a
#                                                decode-step profile at ide-completion's served shape
#   stage 2  carry [".vp2", ".vp1b"]:            unpack vLLM; DeepSeek V4's graph and engine GPU tests;
#                                                with PROFILES=1 host microseconds per step at 32/128/256
#   stage 3  carry [".vp3", ".dummy-qwen3-8b"]:  finish vLLM's site; kvserve's serving runs (the rate
#                                                sweep included), then its offline seed scenarios
#   stage 4  carry [".dummy-qwen3-8b"]:          vLLM's serving runs (about 150 s of start-up)
#   stage 5  carry [".dummy-qwen3-8b"]:          vLLM's offline seed scenarios; with PROFILES=1 first its
#                                                decode-step profile at ide's shape
#   stage 6  carry [".dummy-qwen3-8b"]:          the mixed burst's prefill profiled in both engines
#                                                (burst_prefill_profile.py; about 5 minutes)
# PROFILES=1 (in every stage's command) runs the profiles too: about 5 more minutes of device time.
# Chain the calls at once: a machine idle for 30 s is given back, and the next call starts a bare
# one (a minute or more of device time) without .vp1: stage 2 then needs a call carrying .vp1
# first (nothing else in it), then its own.
# .vp1b holds the first part's last ~2 MB: with this repository's tree, the whole part passed the
# 64 MiB a call may carry.
# Both servers take their web packages (fastapi, uvicorn, pydantic, pyzmq, msgspec) from vLLM's
# site: carrying kvserve's own beside .vp2 would pass the 64 MiB a call may carry.
# Carry .dummy-qwen3-8b in every call that serves: ignored paths not carried are removed there.
# kvserve's server writes its step trace to $OUT/steps_kvserve.tsv (kvserve/engine/step_trace.py).
# Afterwards, here: python benchmarks/plot_serve_load.py RESULTS ide-completion docs/serve_load_ide.png
#   and python benchmarks/offline_scenarios.py --compare RESULTS/offline_kvserve.json RESULTS/offline_vllm.json
# Usage (GPU machine, repo root): bash benchmarks/vllm_compare.sh 1|2|3|4|5|6 ["WORKLOAD:RATE[:N] ..."]
set -u
stage=${1:?stage}
runs=${2:-"ide-completion:30 ide-completion:60 mixed:60:256 ide-completion:10:256 ide-completion:20:256 \
ide-completion:40:384 ide-completion:80:768 ide-completion:100:768"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The GPU-marked tests of the given files. Files that import the server's or the tools' packages
# (fastapi, openai: not on the device image) fail to collect; they hold no GPU tests.
gpu_tests() {
  PYTHONPATH=$PWD timeout ${TEST_SECONDS:-240} python3 -m pytest -q -m gpu --continue-on-collection-errors \
    --ignore tests/test_tensor_parallel_gpu.py $1 2>&1 \
    | grep -v "^ERROR tests" | tail -4 | tee "$2"
}
offline() {  # engine, seconds
  PYTHONPATH=$PWD:$PWD/.vsite timeout $2 python3 benchmarks/offline_scenarios.py --engine $1 \
    --model-dir "$PWD/.dummy-qwen3-8b" --save-json "$OUT/offline_$1.json" 2>&1 \
    | grep -E "^(kvserve|vllm) |Error|error" | tail -12
}
pack() {  # a call brings back at most 8 files: the runs' JSON and server logs go as one archive
  (cd "$OUT" && tar -czf "serve_$1.tgz" *_*.json server_*.log && rm -f *_*.json server_*.log)
}
case $stage in
  1)
    mkdir -p .vsite
    TEST_SECONDS=${TEST_SECONDS:-400} gpu_tests "tests/test_gpu_engine.py tests/test_mixed_graphs.py \
      tests/test_prompt_logprobs.py tests/test_triton_kernels.py tests/test_attention_warmup.py \
      tests/test_batch_tables.py tests/test_fused_ops.py" "$OUT/gpu_tests_1.txt"
    # the served mixed burst offline: host ms, ITL and TTFT with the drain before long eager launches off and on
    PYTHONPATH=$PWD timeout 150 python3 benchmarks/step_diagnostics.py mixedburst 2>&1 \
      | grep -v "^\[\|Warning\|warn" | tail -40 | tee "$OUT/mixedburst.txt"
    [ "${PROFILES:-0}" = 1 ] || exit 0
    # prefill attention against cuDNN and the TMA path, and an 8K eager step's kernel time by kind
    PYTHONPATH=$PWD timeout 120 python3 benchmarks/prefill_headroom.py --quick 2>&1 | grep -v -i warn \
      | tee "$OUT/prefill_headroom.txt"
    PYTHONPATH=$PWD timeout 90 python3 benchmarks/step_diagnostics.py prefill8k 2>&1 | grep -A12 "^prefill8k" \
      | tee "$OUT/prefill8k.txt"
    # ide-completion decodes ~24 rows at ~900-token contexts at 30 req/s: kernels and idle gaps
    PYTHONPATH=$PWD timeout 120 python3 benchmarks/step_diagnostics.py ide24prof 49152 | tee "$OUT/ide24prof.txt" ;;
  2)
    cat .vp1/* .vp1b/* .vp2/* | xz -d -T8 | tar -x -C .vsite
    TEST_SECONDS=150 gpu_tests "tests/test_deepseek_v4_graphs.py tests/test_deepseek_v4_engine.py" \
      "$OUT/gpu_tests_2.txt"
    [ "${PROFILES:-0}" = 1 ] || exit 0
    # host microseconds per step at 32/128/256 running (msgspec from vLLM's site)
    PYTHONPATH=$PWD:$PWD/.vsite timeout 120 python3 benchmarks/host_step_bench.py --model dummy:qwen3-8b \
      --device cuda --running 32,128,256 --steps 24 2>&1 | tail -12 | tee "$OUT/host_step.txt" ;;
  3)
    python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    export PATH=$PWD/.vsite/bin:$PATH
    KVSERVE_STEP_TRACE=$OUT/steps_kvserve.tsv KVSERVE_SYNC_CHECK=1 timeout 420 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "$runs"
    PYTHONPATH=$PWD python3 -m kvserve.engine.step_trace "$OUT/steps_kvserve.tsv" --segments \
      > "$OUT/steps_kvserve_summary.txt"; gzip "$OUT/steps_kvserve.tsv"; pack kvserve
    offline kvserve 150 ;;
  4)
    export PATH=$PWD/.vsite/bin:$PATH
    timeout 560 bash benchmarks/serve_load.sh vllm "$PWD/.dummy-qwen3-8b" "$runs"; pack vllm ;;
  5)
    [ "${PROFILES:-0}" = 1 ] && PYTHONPATH=$PWD:$PWD/.vsite timeout 200 python3 benchmarks/vllm_step_profile.py "$PWD/.dummy-qwen3-8b" \
      2>&1 | grep -E "^vllm|^GPU|ms/step|Error" | tee "$OUT/vllm_ide24prof.txt"
    offline vllm 380 ;;
  6)  # the served mixed burst's prefill, kernel by kernel, in both engines (vLLM: ~140 s of start-up)
    PYTHONPATH=$PWD:$PWD/.vsite timeout 150 python3 benchmarks/burst_prefill_profile.py --engine kvserve \
      --model-dir "$PWD/.dummy-qwen3-8b" 2>&1 | grep -E "^kvserve|^  |^device|Error" | tail -40 | tee "$OUT/burst_kvserve.txt"
    PYTHONPATH=$PWD:$PWD/.vsite timeout 400 python3 benchmarks/burst_prefill_profile.py --engine vllm \
      --model-dir "$PWD/.dummy-qwen3-8b" 2>&1 | grep -E "^vllm|^  |^device|Error" | tail -40 | tee "$OUT/burst_vllm.txt" ;;
  *) echo "stage must be 1 to 6"; exit 2 ;;
esac
