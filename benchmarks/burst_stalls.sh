#!/usr/bin/env bash
# The served mixed burst's host stalls, in one device call (carry [".srv", ".dummy-qwen3-8b"]):
#   1. the launch queue's depth: the driver's default, "1x" and "4x" (CUDA_SCALE_LAUNCH_QUEUES;
#      step_diagnostics.py launchqueue), each in its own process;
#   2. the burst offline (step_diagnostics.py mixedburst: drain off/on/off/on), queue 1x and 4x;
#   3. kvserve serving mixed:60:256 with its step trace (drained tokens sent before the long
#      launch); PROFILE=1 adds a cProfile of the core's steps.
# .srv holds the server's and client's wheels (fastapi, uvicorn, pydantic, pyzmq, msgspec, httpx, ...)
# for Python 3.12: `pip download --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 fastapi uvicorn prometheus-client pyzmq msgspec httpx -d .srv`.
# Usage (GPU machine, repo root): bash benchmarks/burst_stalls.sh [queue|offline|serve ...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
parts=${*:-"queue offline serve"}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .srv ] && [ ! -d .srvsite ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .srvsite .srv/*.whl
fi
for part in $parts; do
  case $part in
    queue)
      for scale in unset 1x 4x; do
        if [ $scale = unset ]; then
          PYTHONPATH=$PWD python3 benchmarks/step_diagnostics.py launchqueue
        else
          CUDA_SCALE_LAUNCH_QUEUES=$scale PYTHONPATH=$PWD python3 benchmarks/step_diagnostics.py launchqueue
        fi
      done 2>&1 | grep "^launchqueue\|Error" | tee "$OUT/launchqueue.txt" ;;
    offline)
      for scale in 1x 4x; do
        CUDA_SCALE_LAUNCH_QUEUES=$scale PYTHONPATH=$PWD timeout 200 python3 benchmarks/step_diagnostics.py mixedburst \
          2>&1 | grep -v "^\[\|Warning\|warn" | tail -8 | sed "s/^/queue $scale: /" | tee -a "$OUT/mixedburst.txt"
      done ;;
    serve)
      export PATH=$PWD/.srvsite/bin:$PATH PYTHONPATH=$PWD/.srvsite
      # PROFILE=1: a cProfile of every core step too ($OUT/core_profile.txt and .pstats)
      [ "${PROFILE:-0}" = 1 ] && export KVSERVE_CORE_PROFILE=$OUT/core_profile.txt
      KVSERVE_STEP_TRACE=$OUT/steps_kvserve.tsv timeout 400 \
        bash benchmarks/serve_load.sh kvserve "$PWD/.dummy-qwen3-8b" "${RUNS:-mixed:60:256}"
      PYTHONPATH=$PWD python3 -m kvserve.engine.step_trace "$OUT/steps_kvserve.tsv" --segments \
        > "$OUT/steps_kvserve_summary.txt"; gzip "$OUT/steps_kvserve.tsv"
      (cd "$OUT" && tar -czf serve_kvserve.tgz *_*.json server_*.log && rm -f *_*.json server_*.log) ;;
    *) echo "part must be queue, offline or serve"; exit 2 ;;
  esac
done
