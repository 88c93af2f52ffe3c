"""What the Gluon kernels' probes and benches share: compiling a kernel for sm_90 without a GPU
(Triton 3.6's Gluon frontend, the device's Triton), reading its registers, spills and shared
memory, and running each variant in its own process, so that a deadlocked mbarrier ring or a
faulting kernel takes down only its own rows.

    PYTHONPATH=<triton 3.6.0 wheel's site> python benchmarks/gluon_prefill_probe.py --compile-only
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from typing import Callable

import triton

SM90_SHARED_BYTES = 232448


def compile_sm90(kernel, signature: dict, constexprs: dict, aligned: list[str], num_warps: int):
    """Compile a Gluon kernel for sm_90 without a GPU, with 16-divisibility on `aligned` arguments
    as a launch on aligned tensors and strides would specialize them."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    signature = signature | {name: "constexpr" for name in constexprs}
    names = list(kernel.arg_names)
    attrs = {(names.index(n), ): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def ptxas_report(ptx: str) -> str:
    """ptxas -v on the PTX (a compiled kernel loaded on no GPU has no register count)."""
    from triton import knobs
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        run = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True)
    return run.stderr + run.stdout


def describe(compiled) -> str:
    """Registers, spills, shared memory, warp-specialize ops and the setmaxnreg budgets."""
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    report = ptxas_report(ptx)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    warp_specialize = len(re.findall(r"ttg\.warp_specialize\b(?!\.)", ttgir))
    budgets = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return (f"regs {regs.group(1) if regs else '?'} (.maxnreg; per partition: setmaxnreg "
            f"{sorted({int(n) for _, n in budgets}, reverse=True)}) "
            f"spills {'/'.join(spills.groups()) + ' B st/ld' if spills else '?'} "
            f"smem {compiled.metadata.shared} B of {SM90_SHARED_BYTES}, warps {compiled.metadata.num_warps}, "
            f"ttg.warp_specialize in TTGIR {warp_specialize}")


def compile_rows(builds: dict[str, Callable[[], object]], width: int) -> int:
    """Compile and describe each named build, a row each; non-zero when any failed."""
    failed = 0
    for name, build in builds.items():
        try:
            print(f"{name:<{width}} {describe(build())}", flush=True)
        except Exception as e:  # noqa: BLE001 - a build that fails is a row
            failed += 1
            print(f"{name:<{width}} failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


def compiled_report(kernel) -> str:
    """Registers and spills of what this process compiled (Triton's cache layout is not an API)."""
    try:
        rows = {f"regs {c.n_regs} spills {c.n_spills} smem {c.metadata.shared}"
                for cache in kernel.device_caches.values() for c in cache[0].values()}
        return "; ".join(sorted(rows))
    except Exception as e:  # noqa: BLE001
        return f"unreadable: {type(e).__name__}: {e}"


def run_in_processes(script: str, variants: list[str], timeout_s: int, width: int) -> int:
    """`script --variant V` for each variant, each in its own process with a time limit."""
    import torch
    print(f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}",
          flush=True)
    failed = 0
    for variant in variants:
        try:
            rc = subprocess.run([sys.executable, script, "--variant", variant], timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout (a hang: mbarrier phases?)"
        if rc != 0:
            failed += 1
            print(f"{variant:<{width}} process failed: {rc}", flush=True)
    return 1 if failed else 0


def probe_main(script: str, doc: str, variants: list[str], run_variant: Callable[[str], None],
               compile_only: Callable[[], int], width: int) -> None:
    """A probe's command line: --compile-only, one --variant in this process, or every
    variant in a process of its own (`run_in_processes`)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    p.add_argument("--variant", choices=variants, help="run one variant in this process")
    p.add_argument("--timeout", type=int, default=240, help="seconds a variant's process may take")
    args = p.parse_args()
    if args.compile_only:
        sys.exit(compile_only())
    if args.variant:
        run_variant(args.variant)
    else:
        sys.exit(run_in_processes(script, variants, args.timeout, width))
