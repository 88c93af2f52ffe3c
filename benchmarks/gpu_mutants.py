"""Hand-written mutants that the GPU suite must catch (run on a CUDA machine).

Each mutant is a one-place edit of the package that a weak GPU test would let
pass: a kernel that drops one long sequence's output (invisible in one
relative error over the whole batch), graphs never replayed (every step
falling back to eager still gives the right tokens), and a V4 per-step
tensor computed behind a branch that the capture skips (vLLM PR 41665's bug
class: right in eager runs, stale in every replay). For each, the package is
copied to a temporary folder, the edit applied, and the named GPU tests run
there; the mutant is killed when they fail.

    python3 benchmarks/gpu_mutants.py            # prints one line per mutant; exit 1 if one survives
    python3 benchmarks/gpu_mutants.py V4         # only the mutants whose name contains "V4"
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("decode kernel zeroes the longest sequence's output", "kvserve/attention/kernels/decode.py",
           "            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim)\n    return out",
           "            SPLITS_POW2=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim)\n"
           "    out[int(seq_lens.argmax())] = 0\n    return out",
           ("tests/test_triton_kernels.py",)),
    Mutant("decode graphs never replayed (eager fallback)", "kvserve/runner/model_runner.py",
           "if self.graphs is not None and meta.is_decode_only",
           "if False and self.graphs is not None and meta.is_decode_only",
           ("tests/test_gpu_engine.py::test_cuda_graph_replay_equals_eager_for_random_batch_sizes",)),
    Mutant("mixed graphs never replayed (eager fallback)", "kvserve/runner/model_runner.py",
           "if self.mixed_graphs is not None and not meta.is_decode_only",
           "if False and self.mixed_graphs is not None and not meta.is_decode_only",
           ("tests/test_gpu_engine.py::test_cuda_graph_replay_equals_eager_for_random_batch_sizes",
            "tests/test_mixed_graphs.py")),
    # The window rope is cached in the batch scratch behind `if key not in scratch`:
    # kept from the warm-up, the capture skips computing it and replays use stale rope.
    Mutant("V4 window rope kept from the graph's warm-up (skipped at capture)", "kvserve/model/deepseek_v4/model.py",
           "            batch.scratch.clear()\n", "            pass\n",
           ("tests/test_deepseek_v4_graphs.py::test_capture_state_gpu",)),
)


def run_tests(m: Mutant, mutate: bool) -> int:
    """pytest's exit status for the mutant's tests, on a mutated copy or an untouched one."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT / "kvserve", Path(tmp) / "kvserve")
        shutil.copytree(ROOT / "tests", Path(tmp) / "tests")
        target = Path(tmp) / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            raise RuntimeError(f"mutant {m.name!r}: the text to replace occurs {text.count(m.old)} times in {m.path}")
        if mutate:
            target.write_text(text.replace(m.old, m.new))
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:cacheprovider", *m.tests]
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True).returncode


def main() -> int:
    """Killed = the tests pass untouched (exit 0) and fail on the mutant (exit 1:
    a collection error or nothing collected does not count as a kill)."""
    chosen = [m for m in MUTANTS if all(word in m.name for word in sys.argv[1:])]
    survivors = 0
    for m in chosen:
        baseline = run_tests(m, mutate=False)
        mutated = run_tests(m, mutate=True) if baseline == 0 else None
        killed = mutated == 1
        survivors += not killed
        verdict = "killed  " if killed else "SURVIVED"
        print(f"{verdict}  {m.name}  (untouched exit {baseline}, mutant exit {mutated}; {', '.join(m.tests)})",
              flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
