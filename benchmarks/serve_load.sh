#!/usr/bin/env bash
# Online load against one engine's OpenAI server on the GPU machine, client `kvserve bench serve`
# with token-id prompts (streaming /v1/completions, Poisson arrivals).
# Usage (repo root): bash benchmarks/serve_load.sh kvserve|vllm MODEL_DIR "WORKLOAD:RATE[:N[:SEED]] ..."
#   MODEL_DIR: config.json + tokenizer (benchmarks/make_dummy_model.py); both engines build dummy weights.
#   N: requests of that run (default 768); SEED: the workload's and arrivals' seed (default 0). env: OUT (result folder), EXTRA (more server flags),
#   CLIENT_PROCESSES (client processes, default 4: one falls behind its schedule past ~60 req/s),
#   PYSPY_SECONDS (py-spy the server and its engine-core process 5 s after the first run's first running request:
#   collapsed stacks per thread in $OUT/pyspy_ENGINE.txt), PROFILE_SECONDS (POST /start_profile PROFILE_DELAY s, default 8, after
#   the first run's first running request and /stop_profile that many seconds later: the server's torch.profiler trace in
#   ${PROFILE_DIR:-$OUT}/prof_ENGINE; compare two with benchmarks/served_profile_compare.py). PROFILE_RUN=k times the
#   window from run k's first running request instead (default 1); that run's client stops after PROFILE_CLIENT_SECONDS
#   (default 300): a run kept for its profile alone need not finish.
# vLLM comes from .vsite (../shared/peers/vllm/README.md); its site also carries kvserve's server deps.
set -u
engine=${1:?engine} dir=${2:?model dir} runs=${3:?runs}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; port=8011
export PYTHONPATH=$PWD:$PWD/.vsite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
flags="--model $dir --load-format dummy --port $port --max-num-batched-tokens 8192 --max-model-len 8192 \
  --gpu-memory-utilization 0.85 ${EXTRA:-}"
if [ "$engine" = vllm ]; then
  cmd="python3 -m vllm.entrypoints.openai.api_server --served-model-name m $flags"
else
  cmd="python3 -m kvserve.cli serve $flags"
fi
if [ -n "${PROFILE_SECONDS:-}" ]; then   # kvserve's variable, vLLM's flag
  prof="${PROFILE_DIR:-$OUT}/prof_$engine"; rm -rf "$prof"; mkdir -p "$prof"
  export KVSERVE_TORCH_PROFILER_DIR="$prof"
  # vLLM 0.26 reads no environment variable for it: its --profiler-config (vllm/config/profiler.py)
  [ "$engine" = vllm ] && cmd="$cmd --profiler-config \
{\"profiler\":\"torch\",\"torch_profiler_dir\":\"$prof\",\"torch_profiler_with_stack\":false,\"ignore_frontend\":true}"
fi
echo "\$ $cmd"; start=$(date +%s)
$cmd > "$OUT/server_$engine.log" 2>&1 & server=$!
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  sleep 2
  if ! kill -0 $server 2> /dev/null || [ $(( $(date +%s) - start )) -gt 400 ]; then
    echo "server did not come up"; tail -30 "$OUT/server_$engine.log"; exit 1
  fi
done
echo "startup $(( $(date +%s) - start )) s"
running() {  # the server's running-request gauge (kvserve's or vLLM's name), 0 when absent
  curl -s "http://127.0.0.1:$port/metrics" | awk '/^(kvserve|vllm):num_requests_running/ {n += $NF} END {print n + 0}'
}
# py-spy and the profile window count from run PROFILE_RUN's first running request, not from start-up:
# the client takes ~20 s to build 512+ token-id prompts in 4 processes, and a window timed from
# start-up closed before the first request (a trace of 0 steps).
after_first_request() {  # of run ${PROFILE_RUN:-1}: the loop below writes each run's number to $OUT/.run
  until [ "$(cat "$OUT/.run" 2> /dev/null)" = "${PROFILE_RUN:-1}" ]; do sleep 0.1; done
  for _ in $(seq 600); do [ "$(running)" != 0 ] && break; sleep 0.1; done; sleep "$1"
}
rm -f "$OUT/.run"   # before the watchers start: a stale run number would open their windows early
if [ -n "${PYSPY_SECONDS:-}" ]; then
  (after_first_request 5; py-spy record --pid $server --subprocesses --threads --nonblocking --format raw \
    --duration "$PYSPY_SECONDS" --rate 250 -o "$OUT/pyspy_$engine.txt" > "$OUT/pyspy.log" 2>&1) &
fi
if [ -n "${PROFILE_SECONDS:-}" ]; then
  (after_first_request "${PROFILE_DELAY:-8}"
   curl -s -X POST "http://127.0.0.1:$port/start_profile"; sleep "$PROFILE_SECONDS"
   curl -s --max-time 300 -X POST "http://127.0.0.1:$port/stop_profile"; echo) > "$OUT/profile_$engine.log" 2>&1 &
  profiler=$!
fi
k=0
for run in $runs; do
  IFS=: read -r w r n seed <<< "$run"; n=${n:-768} seed=${seed:-0}; k=$((k + 1)); echo $k > "$OUT/.run"
  seconds=300 tag=
  [ -n "${PROFILE_SECONDS:-}" ] && [ $k = "${PROFILE_RUN:-1}" ] && seconds=${PROFILE_CLIENT_SECONDS:-300} tag=_profiled
  echo "\$ kvserve bench serve --workload $w --num-prompts $n --request-rate $r --seed $seed --tokenizer $dir --max-len 8192 --client-processes ${CLIENT_PROCESSES:-4}"
  timeout $seconds python3 -m kvserve.cli bench serve --url "http://127.0.0.1:$port" --workload "$w" \
    --num-prompts "$n" --request-rate "$r" --seed "$seed" --tokenizer "$dir" --max-len 8192 --client-processes "${CLIENT_PROCESSES:-4}" \
    --save-json "$OUT/${engine}_${w}_${r}${tag}.json" 2>&1 | grep -E "^(=|Succ|Failed|Bench|Request thr|Send lag|latency|TTFT|ITL|E2E|Prefix|Preem|errors)" | cut -c1-160
done
[ -n "${profiler:-}" ] && wait "$profiler"   # the trace is written before the server goes
kill $server; wait $server 2> /dev/null
