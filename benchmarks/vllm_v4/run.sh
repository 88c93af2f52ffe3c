#!/usr/bin/env bash
# Device call B (and re-runs while the machine is warm) of benchmarks/vllm_v4/README.md: join the kit parts
# (part 1 kept in /tmp by probe.sh in call A, part 2 carried as the ignored .v4try/c2/part), check them,
# unpack the kit (tilelang 0.1.9, z3-solver, torch-c-dlpack-ext, nvidia-cutlass-dsl 4.6.0 [cu13],
# quack-kernels 0.6.0) into .vsite next to vLLM and tvm_ffi, then run benchmarks/vllm_v4/try_v4.py.
# Env V4_* passes through to the script.
set -u -o pipefail
cd "$(dirname "$0")/../.."
SHA=c22ab3330475438b0316af9f16a5035b00c5a4b60182a11e71e33a7162eb891c
[ -d .vsite/vllm ] || { echo "MISSING .vsite/vllm: the vLLM bundle is not on this machine (it went cold?)"; exit 3; }
if [ ! -f .vsite/.v4kit_ok ]; then
  [ -f /tmp/v4kit.p1 ] || { echo "MISSING /tmp/v4kit.p1: call A's part did not survive (machine went cold?)"; exit 3; }
  [ -f .v4try/c2/part ] || { echo "MISSING .v4try/c2/part: carry .v4try/c2 in this call"; exit 3; }
  cat /tmp/v4kit.p1 .v4try/c2/part > /tmp/v4kit.tar.xz
  echo "$SHA  /tmp/v4kit.tar.xz" | sha256sum -c - || exit 4
  t=$(date +%s); xz -d -T0 < /tmp/v4kit.tar.xz | tar -x -C .vsite || exit 5
  touch .vsite/.v4kit_ok; echo "kit unpacked into .vsite in $(( $(date +%s) - t ))s"; rm -f /tmp/v4kit.tar.xz
else
  echo "kit already unpacked in .vsite (re-run)"
fi
export PYTHONPATH=$PWD/.vsite:$PWD/.vsite/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
LOG=${OUT:-/tmp}/try_v4.log
timeout -k 15 ${V4_TIMEOUT:-470} python3 benchmarks/vllm_v4/try_v4.py 2>&1 | tee "$LOG"
rc=$?; echo "try_v4.py exit code: $rc (124 = killed by timeout)"; exit $rc
