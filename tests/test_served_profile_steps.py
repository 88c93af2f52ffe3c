"""benchmarks/served_profile_compare.py's step view: a trace cut at each sampler argmax,
steps with a prefill kernel counted as mixed, idle gaps inside a step measured."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "served_profile_compare", Path(__file__).resolve().parents[1] / "benchmarks" / "served_profile_compare.py")
spc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spc)

ARGMAX = "reduce_kernel<ArgMaxOps>"


def _trace():
    """Four steps of (start us, duration us, name): a partial one the window cut into, a decode
    step, a mixed step with a 30 us idle gap, another decode step."""
    return [(0, 5, "gemm"), (5, 1, ARGMAX),
            (10, 50, "gemm"), (60, 20, "_work_kernel"), (80, 1, ARGMAX),
            (90, 50, "gemm"), (170, 10, "_prefill_kernel"), (180, 5, "_prefill_reduce_kernel"), (185, 1, ARGMAX),
            (190, 40, "gemm"), (230, 20, "_work_kernel"), (250, 1, ARGMAX)]


def test_steps_are_cut_at_the_argmax_and_the_first_dropped():
    steps = spc.steps_of(_trace())
    assert [len(s) for s in steps] == [3, 4, 3]
    assert [spc.largest_gap(s) for s in steps] == [0, 30, 0]


def test_by_step_splits_mixed_from_decode():
    lines = spc.by_step(_trace(), top=2)
    assert lines[0].startswith("mixed: 1 steps, span 96 us") and "longest gap of all: 30 us" in lines[0]
    decode = next(line for line in lines if line.startswith("decode:"))
    assert decode.startswith("decode: 2 steps, span 66 us")
    assert lines[-2:] == ["the 1 mixed steps with the least prefill attention (us):",
                          "  gemm 50, _prefill_kernel 10, _prefill_reduce_kernel 5, reduce_kernel<ArgMaxOps> 1"]
