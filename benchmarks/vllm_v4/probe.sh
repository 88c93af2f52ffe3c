#!/usr/bin/env bash
# Device call A of benchmarks/vllm_v4/README.md: keep kit part 1 (the ignored .v4try/c1/part, carried) in
# /tmp, where it stays while the machine is warm, and print what the image and the vLLM bundle (.vsite)
# provide for the DeepSeek V4 path. Writes nothing else.
set -u
cd "$(dirname "$0")/../.."
cp .v4try/c1/part /tmp/v4kit.p1 && echo "part1 kept: $(stat -c %s /tmp/v4kit.p1) bytes"
echo "--- gpu / toolchain"; nvidia-smi -L 2>&1 | head -2
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null); echo "nvcc: ${NVCC:-NOT FOUND}"; [ -n "$NVCC" ] && "$NVCC" --version | tail -2
echo "CUDA_HOME=${CUDA_HOME:-unset}"
echo "--- image packages the kit relies on"
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|triton|transformers|numpy|cuda-bindings|cuda-python|cuda-core|cuda-pathfinder|protobuf|ml.dtypes|cloudpickle|psutil|tqdm|typing.extensions|einops|jax) " 
echo "--- vLLM bundle in .vsite"
if [ -d .vsite/vllm ]; then
  PYTHONPATH=$PWD/.vsite timeout 120 python3 -c "import vllm, tvm_ffi; print('vllm', vllm.__version__, '| tvm_ffi', tvm_ffi.__version__)" 2>&1 | tail -2
  for p in tilelang cutlass quack z3 nvidia_cutlass_dsl; do [ -e .vsite/$p ] && echo "note: .vsite/$p already present"; done
else
  echo "MISSING: .vsite/vllm (run the three vLLM-bundle calls first, back to back)"
fi
df -h /tmp . 2>/dev/null | tail -2
