#!/usr/bin/env bash
# The served mixed burst's prefill (burst_prefill_profile.py, kvserve) for a base tree and the
# working tree, alternating in one device call: wall, kernel time by kind and device idle of each.
# The base: `git archive BASE kvserve benchmarks/burst_prefill_profile.py benchmarks/offline_scenarios.py
# > .base.tar` here, carried with .dummy-qwen3-8b (and .srv, the web wheels, on a bare machine).
# With BASE_ENV="NAME=VALUE ..." and no .base.tar, the base is the working tree run with those
# variables set (e.g. BASE_ENV=KVSERVE_GLUON_PREFILL=0: the TMA path's Triton kernel).
# Usage (GPU machine, repo root): bash benchmarks/burst_ab.sh [ROUNDS]   -> $OUT/burst_ab.txt
set -u
rounds=${1:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=/tmp/site
[ -d .srv ] && python3 -m pip install -q --no-index --no-deps --no-compile --target $site .srv/*.whl > /dev/null 2>&1
[ -d .vsite ] && site=$PWD/.vsite   # vllm_compare.sh's stage 3 unpacked vLLM's site (the web wheels with it)
base_dir=$PWD
if [ -f .base.tar ]; then
  base_dir=/tmp/base; rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf .base.tar -C /tmp/base
fi
for _ in $(seq "$rounds"); do
  for tree in new base; do
    dir=$PWD; env_set=""
    [ $tree = base ] && dir=$base_dir && env_set=${BASE_ENV:-}
    (cd "$dir" && env $env_set PYTHONPATH=$dir:$site PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/burst_prefill_profile.py \
      --engine kvserve --model-dir "$OLDPWD/.dummy-qwen3-8b" 2>&1 \
      | grep -E "^kvserve|^  gemm|^device idle|^  gaps 100|ms/step  Memcpy|Error" | sed "s/^/$tree: /") | tee -a "$OUT/burst_ab.txt"
  done
done
