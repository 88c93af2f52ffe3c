#!/usr/bin/env bash
# The serving comparison with vLLM 0.26.0 in one device lease, six calls back to back. The vLLM
# bundle (../shared/peers/vllm/README.md: one ~115 MB .tar.xz stream plus ~50 MB of wheels) no
# longer fits two calls beside this repository's tree (~10 MB): a call carries at most 64 MiB with
# the tree. Cut the stream in three (`benchmarks/vllm_bundle_split.sh`): .vp1 and .vp2 fill a call
# each, .vp2b (the last few MB) travels with the wheels (.vp3) and the model directory.
#   stage 1  carry [".vp1"]:                          GPU tests of the engine, its graphs, the batch
#                                                     tables, fused ops and the decode work list; with CUDNN_ROWS=1 the
#                                                     prefill probe `prefill_headroom.py --cudnn-rows`
#   stage 2  carry [".vp2"]:                          GPU tests of the attention kernels and their warm-up
#   stage 2b carry [".vp2b"]:                         unpack vLLM's stream (.vp1 + .vp2 + .vp2b) into .vsite,
#                                                     when the tree has grown so far that .vp2b no longer fits
#                                                     stage 3's carry (vllm_bundle_split.sh warns; it does at
#                                                     0c8737a: .vp3 + .vp2b + the tree > 64 MiB). Unpack in that
#                                                     call: a later call that does not carry .vp2b found it gone
#   stage 3  carry [".vp3", ".vp2b", ".dummy-qwen3-8b", ".base.tar"] (less what 2b carried):
#                                                     unpack vLLM and its wheels; host microseconds per
#                                                     step at 32/128/256 (real forward; HOST=0 skips it), with .base.tar
#                                                     (`git archive BASE kvserve`) and BASE=rev an A/B
#                                                     against it; the mixed burst's prefill profiled
#                                                     (burst_prefill_profile.py; with AB_ROUNDS=n and
#                                                     .base.tar, burst_ab.sh's base/new A/B instead); with
#                                                     OFFLINE=1 the offline seed scenarios
#   stage 4  carry [".dummy-qwen3-8b", ".srv"]:       kvserve's serving runs (the rate sweep included); without
#                                                     vLLM's site (a fresh machine) its web packages from .srv
#   stage 5  carry [".dummy-qwen3-8b"]:               vLLM's serving runs (about 150 s of start-up)
#   stage 6  carry [".dummy-qwen3-8b"]:               vLLM's burst prefill profile (about 140 s of
#                                                     start-up; BURST=0 skips it); with OFFLINE=1 its
#                                                     offline seed scenarios
#   stage 7  carry [".dummy-qwen3-8b"]:               kvserve's offline seed scenarios alone (after stage 3);
#                                                     OFFLINE_ARGS adds offline_scenarios.py flags to both engines'
#                                                     runs (e.g. "--scenarios ide-completion --seeds 0 1 2", or
#                                                     "--also ide-completion@1 ide-completion@2"), OFFLINE_SECONDS
#                                                     its time limit (stage 3: 150, 6: 380, 7: 200)
#   stage 8  (no carry needed):                       the Gluon probes on the GPU (benchmarks/gluon_*_probe.py:
#                                                     each variant checked against float32, then timed)
#   stage 9  (after stages 4 and 5 with PROFILE_SECONDS=N): the two servers' /start_profile windows
#                                                     side by side (benchmarks/served_profile_compare.py);
#                                                     the traces wait in $PROFILE_DIR (default /tmp/served_profiles),
#                                                     and stages 4 and 5 also return them as $OUT/prof_ENGINE.tgz:
#                                                     unpacked here, the script compares them without a GPU
#   stage 10 carry [".srv", ".dummy-qwen3-8b"]:       kvserve alone, no bundle: the TMA path's two kernels
#                                                     (tma_kernel_ab.py), the burst with the Gluon kernel
#                                                     against the Triton one (burst_ab.sh), and host
#                                                     microseconds per step by GPU wait mode
#   stage 11 carry [".srv", ".dummy-qwen3-8b"]:       kvserve alone: a 2 s profiler window of the served
#                                                     ide-completion run at 30 req/s (device busy and idle
#                                                     a step, kernel by kernel), then the offline decode
#                                                     profile of the same shape, with and without shared
#                                                     prefixes (step_diagnostics ide24prof, ide24solo)
#   stage 12 (no carry needed):                       DeepSeek V4's Gluon sparse decode kernel: its GPU tests
#                                                     (tests/test_v4_sparse_gluon.py), then the decode path
#                                                     (v4_kernel_bench.py --path-only: the default configs alone) with KVSERVE_GLUON_SPARSE=0 and =1
#   stage 13 (no carry needed):                       shared-prefix (cascade) decode attention: its GPU test,
#                                                     then cascade_decode_probe.py against the decode kernel
#   stage 14 carry [".srv", ".dummy-qwen3-8b"]:       kvserve alone, served ide-completion at 30 and 60 with
#                                                     KVSERVE_CASCADE=$CASCADE (run with CASCADE=0, then 1):
#                                                     the client's table and the decode period by rows
#   stage 15 carry [".srv", ".dummy-qwen3-8b"]:       work-list decode (kernels/decode_work.py): its GPU tests, its
#                                                     probe against even splits, then kvserve served at 30 and 60
#                                                     with KVSERVE_DECODE_WORK=0 and =1 (WORK="1" for one side)
#   stage 16 carry [".vp2b", ".dummy-qwen3-8b"], then [".vp3"]: one offline scenario profiled kernel by kernel
#                                                     (scenario_profile.py; SCENARIO, default ide-completion@0) in
#                                                     ENGINE (kvserve or vllm). The first call unpacks vLLM's stream
#                                                     and keeps the model directory in .vsite/model: .vp3 with the
#                                                     tree leaves no room for it; the second installs .vp3's wheels
# Where vllm_bundle_split.sh moved wheels to .vp4, carry .vp4 with .vp2b and install it with .vp3.
# Chain the calls at once: a machine idle for 30 s is given back, and the next call starts a bare
# one (a minute or more of device time) without the parts carried before.
# Both servers take their web packages (fastapi, uvicorn, pydantic, pyzmq, msgspec) from vLLM's
# site (.vp3's wheels). Stages 10, 11, 14 and 15 (kvserve alone) take them from .srv, built here:
#   python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     fastapi uvicorn uvloop httptools prometheus-client pyzmq msgspec httpx -d .srv
# (uvloop and httptools: without them uvicorn parses requests in pure Python, as kvserve's server
# did in the record of 2026-12-04 11:41 UTC while vLLM's had both).
# Carry .dummy-qwen3-8b in every call that serves: ignored paths not carried are removed there.
# kvserve's server writes its step trace to $OUT/steps_kvserve.tsv (kvserve/engine/step_trace.py).
# Afterwards, here: python benchmarks/plot_serve_load.py RESULTS ide-completion docs/serve_load_ide.png
#   and python benchmarks/offline_scenarios.py --compare RESULTS/offline_kvserve.json RESULTS/offline_vllm.json
# Usage (GPU machine, repo root): bash benchmarks/vllm_compare.sh 1|...|16 ["WORKLOAD:RATE[:N] ..."]
set -u
stage=${1:?stage}
runs=${2:-"ide-completion:30 ide-completion:60 mixed:60:256 ide-completion:10:256 ide-completion:20:256 \
ide-completion:40:384 ide-completion:80:768 ide-completion:100:768"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PROFILE_DIR=${PROFILE_DIR:-/tmp/served_profiles}   # serve_load.sh's, kept between calls
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
    --model-dir "$PWD/.dummy-qwen3-8b" --save-json "$OUT/offline_$1.json" ${OFFLINE_ARGS:-} 2>&1 \
    | grep -E "^(kvserve|vllm) |Error|error" | tail -12
}
unpack() {  # vLLM's stream (.vp1 + .vp2 + .vp2b) into .vsite, and the wheels moved to .vp4 if carried
  mkdir -p .vsite && cat .vp1/* .vp2/* .vp2b/* | xz -d -T16 | tar -x -C .vsite
  [ -d .vp4 ] && python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp4/*.whl || true
}
pack() {  # a call brings back at most 8 files: the runs' JSON and server logs go as one archive
  (cd "$OUT" && tar -czf "serve_$1.tgz" *_*.json server_*.log && rm -f *_*.json server_*.log)
}
keep_profile() {  # the profile window's trace comes back with the call: the machine may be gone by stage 9
  [ -n "${PROFILE_SECONDS:-}" ] && tar -czf "$OUT/prof_$1.tgz" -C "$PROFILE_DIR" "prof_$1" || true
}
case $stage in
  16)  # one offline scenario, kernel by kernel, in ENGINE (a call per engine: kvserve's carries .vp2b and the model)
    [ -d .dummy-qwen3-8b ] && { mkdir -p .vsite && rm -rf .vsite/model && cp -r .dummy-qwen3-8b .vsite/model; }
    [ -d .vp2b ] && [ ! -d .vsite/vllm ] && unpack
    [ -d .vp3 ] && python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    PYTHONPATH=$PWD:$PWD/.vsite timeout ${PROFILE_LIMIT:-420} python3 benchmarks/scenario_profile.py --engine "${ENGINE:?}" \
      --model-dir "$PWD/.vsite/model" --scenario "${SCENARIO:-ide-completion@0}" 2>&1 \
      | grep -E "^(kvserve|vllm)|^  |^device|Error" | tail -45 | tee "$OUT/scenario_$ENGINE.txt" ;;
  1)
    TEST_SECONDS=${TEST_SECONDS:-240} gpu_tests "tests/test_gpu_engine.py tests/test_mixed_graphs.py \
      tests/test_prompt_logprobs.py tests/test_batch_tables.py tests/test_fused_ops.py tests/test_decode_work.py" \
      "$OUT/gpu_tests_1.txt"
    # with CUDNN_ROWS=1: the ragged burst step as one dense cuDNN call a row, against the TMA path
    [ "${CUDNN_ROWS:-0}" = 1 ] && PYTHONPATH=$PWD timeout 120 python3 benchmarks/prefill_headroom.py --cudnn-rows 2>&1 \
      | grep -v -i warn | tee "$OUT/cudnn_rows.txt" || true ;;   # an option off is no failure
  2)
    TEST_SECONDS=${TEST_SECONDS:-150} gpu_tests "tests/test_triton_kernels.py tests/test_attention_warmup.py" \
      "$OUT/gpu_tests_2.txt" ;;
  2b)  # carry [".vp2b"]: the stream's three parts unpacked while all three are there
    unpack ;;
  3)
    [ -d .vsite/vllm ] || unpack
    python3 -m pip install -q --no-index --no-deps --no-compile --target .vsite .vp3/*.whl
    # host microseconds per step at 32/128/256 running (msgspec from vLLM's site); HOST=0 skips it
    [ "${HOST:-1}" = 1 ] && PYTHONPATH=$PWD:$PWD/.vsite timeout 120 python3 benchmarks/host_step_bench.py \
      --model dummy:qwen3-8b --device cuda --running 32,128,256 --steps 48 2>&1 | tail -6 | tee "$OUT/host_step.txt"
    if [ -n "${BASE:-}" ] && [ -f .base.tar ]; then
      PYTHONPATH=$PWD:$PWD/.vsite timeout 150 python3 benchmarks/host_step_ab.py --base "$BASE" --base-archive .base.tar \
        --running 256 --steps 80 --device cuda --num-kv-blocks 24000 --dtype float32 2>&1 | tail -9 | tee "$OUT/host_ab.txt"
    fi
    if [ "${BURST:-1}" = 0 ]; then   # a call carrying .vp3 alone (no model directory): the install and host bench
      :
    elif [ -n "${AB_ROUNDS:-}" ] && [ -f .base.tar ]; then
      bash benchmarks/burst_ab.sh "$AB_ROUNDS"
    else
      PYTHONPATH=$PWD:$PWD/.vsite timeout 150 python3 benchmarks/burst_prefill_profile.py --engine kvserve \
        --model-dir "$PWD/.dummy-qwen3-8b" 2>&1 | grep -E "^kvserve|^  |^device|Error" | tail -40 | tee "$OUT/burst_kvserve.txt"
    fi
    [ "${OFFLINE:-0}" = 1 ] && offline kvserve ${OFFLINE_SECONDS:-150} || true ;;
  4)
    export PATH=$PWD/.vsite/bin:$PATH
    # a fresh machine (the last one went back while idle) has no vLLM site: kvserve's web packages
    # then come from .srv, when the call carries it
    if [ ! -d .vsite/uvicorn ] && [ -d .srv ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .srv/*.whl
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    KVSERVE_STEP_TRACE=$OUT/steps_kvserve.tsv KVSERVE_SYNC_CHECK=1 timeout 560 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "$runs"
    PYTHONPATH=$PWD python3 -m kvserve.engine.step_trace "$OUT/steps_kvserve.tsv" --segments \
      > "$OUT/steps_kvserve_summary.txt"; gzip "$OUT/steps_kvserve.tsv"; pack kvserve; keep_profile kvserve ;;
  5)
    export PATH=$PWD/.vsite/bin:$PATH
    timeout 580 bash benchmarks/serve_load.sh vllm "$PWD/.dummy-qwen3-8b" "$runs"; pack vllm; keep_profile vllm ;;
  6)  # the served mixed burst's prefill, kernel by kernel, as kvserve's was in stage 3
    [ "${BURST:-1}" = 1 ] && PYTHONPATH=$PWD:$PWD/.vsite timeout 400 python3 benchmarks/burst_prefill_profile.py \
      --engine vllm --model-dir "$PWD/.dummy-qwen3-8b" 2>&1 | grep -E "^vllm|^  |^device|Error" | tail -40 \
      | tee "$OUT/burst_vllm.txt"
    [ "${OFFLINE:-0}" = 1 ] && offline vllm ${OFFLINE_SECONDS:-380} || true ;;
  7)
    offline kvserve ${OFFLINE_SECONDS:-200} ;;
  8)
    for probe in benchmarks/gluon_*_probe.py; do   # a variant that hangs (an mbarrier ring) is killed after 60 s
      PYTHONPATH=$PWD:$PWD/benchmarks timeout 400 python3 "$probe" --timeout 60 2>&1 | grep -v -i warn | tail -40 \
        | tee "$OUT/$(basename "$probe" .py).txt"
    done ;;
  9)
    PYTHONPATH=$PWD python3 benchmarks/served_profile_compare.py "$PROFILE_DIR/prof_kvserve" "$PROFILE_DIR/prof_vllm" \
      2>&1 | tee "$OUT/served_profile_compare.txt" ;;
  10)
    PYTHONPATH=$PWD:$PWD/benchmarks timeout 130 python3 benchmarks/tma_kernel_ab.py 2>&1 | grep -v -i warn \
      | tee "$OUT/tma_kernel_ab.txt"
    BASE_ENV=KVSERVE_GLUON_PREFILL=0 timeout 270 bash benchmarks/burst_ab.sh "${AB_ROUNDS:-1}"
    for mode in auto spin spin auto; do   # ABBA against order effects; burst_ab.sh installed msgspec into /tmp/site
      PYTHONPATH=$PWD:/tmp/site timeout 80 python3 benchmarks/host_step_bench.py --model dummy:qwen3-8b --device cuda \
        --running 256 --steps 48 --wait-mode $mode 2>&1 | grep -v -i warn | tail -4
    done | tee "$OUT/host_wait_modes.txt" ;;
  11)  # a served decode step against the same shape offline: where the served step's extra time goes
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .srv/*.whl
    PYTHONPATH=/tmp/site PROFILE_SECONDS=${PROFILE_SECONDS:-2} timeout 220 bash benchmarks/serve_load.sh kvserve \
      "$PWD/.dummy-qwen3-8b" "ide-completion:30:512" 2>&1 | grep -E "^(TTFT|ITL|Request thr)"
    PYTHONPATH=$PWD timeout 60 python3 benchmarks/served_profile_compare.py "$PROFILE_DIR/prof_kvserve" \
      "$PROFILE_DIR/prof_kvserve" 2>&1 | tee "$OUT/served_profile_kvserve.txt" | head -40
    for shape in ide24prof ide24solo; do   # three requests a prefix, then none shared
      # The whole profile to the file (its head holds the per-kernel ms a step), its tail to the log.
      PYTHONPATH=$PWD timeout 120 python3 benchmarks/step_diagnostics.py $shape 49152 2>&1 | grep -v -i warn \
        > "$OUT/$shape.txt"; tail -30 "$OUT/$shape.txt"
    done ;;
  12)  # DeepSeek V4's Gluon sparse decode kernel: its GPU tests, then the decode path without and with it
    PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -m gpu tests/test_v4_sparse_gluon.py 2>&1 | tail -4 \
      | tee "$OUT/gpu_tests_v4_gluon.txt"
    for on in 0 1; do
      KVSERVE_GLUON_SPARSE=$on PYTHONPATH=$PWD timeout 150 python3 benchmarks/v4_kernel_bench.py --no-extras \
        --path-only --contexts 32768 131072 --batches 64 256 2>&1 | grep -v -i warn | tail -24
    done | tee "$OUT/v4_gluon_ab.txt" ;;
  13)  # shared-prefix (cascade) decode attention: its GPU test, then against the decode kernel
    PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -m gpu tests/test_cascade_attention.py 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_cascade.txt"
    PYTHONPATH=$PWD timeout 300 python3 benchmarks/cascade_decode_probe.py 2>&1 | grep -v -i warn \
      | tee "$OUT/cascade_probe.txt" ;;
  14)  # kvserve alone, served ide-completion at 30 and 60 with KVSERVE_CASCADE=${CASCADE:-1} (call twice: 0, 1)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .srv/*.whl
    on=${CASCADE:-1}; runs_out=$OUT/cascade$on; trace=$OUT/steps_cascade$on.tsv; mkdir -p "$runs_out"
    OUT=$runs_out KVSERVE_CASCADE=$on KVSERVE_STEP_TRACE=$trace PYTHONPATH=/tmp/site timeout 520 \
      bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "ide-completion:30 ide-completion:60" 2>&1 \
      | grep -E "^(=|TTFT|ITL|E2E|Request thr)"
    PYTHONPATH=$PWD python3 -m kvserve.engine.step_trace "$trace" --segments | grep -E "segment|by rows" \
      | tee "$OUT/steps_cascade${on}_rows.txt" ;;
  15)  # work-list decode: its GPU tests and probe (PROBE=0 skips them), then kvserve served with KVSERVE_DECODE_WORK=${WORK:-0 1}
    if [ "${PROBE:-1}" = 1 ]; then
      PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -m gpu tests/test_decode_work.py 2>&1 | tail -3 \
        | tee "$OUT/gpu_tests_decode_work.txt"
      PYTHONPATH=$PWD timeout 120 python3 benchmarks/decode_work_probe.py --batches 24 32 51 112 --work-waves 4 8 2>&1 | grep -v -i warn \
        | tee "$OUT/decode_work_probe.txt"
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .srv/*.whl
    for on in ${WORK:-0 1}; do
      runs_out=$OUT/work$on; trace=$OUT/steps_work$on.tsv; mkdir -p "$runs_out"
      OUT=$runs_out KVSERVE_DECODE_WORK=$on KVSERVE_STEP_TRACE=$trace PYTHONPATH=/tmp/site timeout 260 \
        bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "${RUNS:-ide-completion:30 ide-completion:60}" 2>&1 \
        | grep -E "^(=|TTFT|ITL|E2E|Request thr)"
      PYTHONPATH=$PWD python3 -m kvserve.engine.step_trace "$trace" --segments | grep -E "segment|by rows|gpu span" \
        | tee "$OUT/steps_work${on}_rows.txt"
    done ;;
  *) echo "stage must be 1, 2, 2b or 3 to 15"; exit 2 ;;
esac
