#!/usr/bin/env bash
# Builds the kit's two archive parts, .v4try/c1/part and .v4try/c2/part at the repository root (ignored by
# git: about 46 MB each, never committed), on a CPU machine with a pip index; any Python, nothing is compiled.
# The kit is the set of packages vLLM 0.26.0's DeepSeek V4 NVIDIA path imports that the GPU image and the
# vLLM bundle (.vp1-.vp3) lack, at the versions vLLM 0.26.0 pins in its METADATA:
#   tilelang==0.1.9 (mHC kernels; needs apache-tvm-ffi ~=0.1 >=0.1.2, so the bundle's 0.1.10 serves it),
#   z3-solver 4.15.4.0 (libtvm.so NEEDs libz3.so; tilelang pins >=4.13,<4.15.5), torch-c-dlpack-ext 0.1.5,
#   nvidia-cutlass-dsl[cu13]==4.6.0 = meta + libs-base + libs-core + libs-cu13 (cute-dsl ops),
#   quack-kernels 0.6.0 (pins nvidia-cutlass-dsl==4.6.0; vLLM imports quack.compile_utils etc.).
# Installed with pip --target (plain unpack), bin/ and the stray build_backend.py dropped, tar | xz -9,
# split in two equal parts. On the device, run.sh joins, checks the sha256 and unpacks into .vsite, so that
# tilelang's RUNPATH ($ORIGIN/../../tvm_ffi/lib, $ORIGIN/../../z3/lib) finds .vsite/tvm_ffi and .vsite/z3.
set -eu
W=/tmp/v4w2; S=/tmp/v4stage/site; K=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$K/../.." && pwd)
P="$ROOT/.v4try"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
DL="$PIP download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 -d $W"
mkdir -p $W
for p in tilelang==0.1.9 z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl==4.6.0 \
         nvidia-cutlass-dsl-libs-base==4.6.0 nvidia-cutlass-dsl-libs-core==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0 \
         quack-kernels==0.6.0; do $DL "$p"; done
(cd $W && sha256sum -c <(sed 's/ /  /' "$K/WHEELS.sha256"))
rm -rf $S; $PIP install -q --no-deps --no-compile --target $S --python-version 3.12 --implementation cp \
  --only-binary=:all: --platform manylinux_2_28_x86_64 $W/*.whl
rm -rf $S/bin $S/build_backend.py
tar --owner=0 --group=0 --sort=name -C $S -cf - . | xz -T2 -9 > /tmp/v4stage/v4kit.tar.xz
split -n 2 -d /tmp/v4stage/v4kit.tar.xz /tmp/v4stage/part_
mkdir -p "$P/c1" "$P/c2"; mv /tmp/v4stage/part_00 "$P/c1/part"; mv /tmp/v4stage/part_01 "$P/c2/part"
git -C "$ROOT" check-ignore -q "$P/c1/part" || echo "note: .v4try/ is not ignored: run  echo .v4try/ >> .git/info/exclude"
sha256sum /tmp/v4stage/v4kit.tar.xz   # a rebuild has new file mtimes, so a new sum: put it in SHA= of run.sh
