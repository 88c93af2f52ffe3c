"""Host microseconds per engine step, two versions of kvserve in one process.

On a machine whose speed drifts (this project's 2-core CPU read 2x apart
between runs of the same code) separate runs of host_step_bench.py cannot
show a 10-20% change. Here a base commit's package, exported from git and
renamed (kvserve -> kvserve_base, so both import side by side), and the
working tree's each build an engine with the same requests, through the same
bench code (the working tree's host_step_bench.py, its imports renamed for
the base); timed steps alternate between them (the order flips every step),
so both see the same machine. Per part: both medians and the median of the
per-step ratios.

    python benchmarks/host_step_ab.py --base 96714f4 --running 256 --steps 60 [host_step_bench.py flags]

The GPU machine's copy of the tree has no current git history: there, pass the
base's package as a tar made here (`git archive 96714f4 kvserve > .base.tar`,
carried) with `--base-archive .base.tar`. On CUDA the stub forward needs
`--dtype float32` (its zeros are float32) and both engines need room:
`--num-kv-blocks 24000` instead of a share of the GPU each.

`--stub-forward` is on unless `--real-forward` is given (CPU: the host parts
do not depend on the layers). Parts as in host_step_bench.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("schedule", "bookkeeping", "metrics", "input_prep", "host_total", "core_out", "launch_rest")
_PACKAGE = re.compile(r"\bkvserve\b(?!_base)")


def export_base(rev: str, dest: Path, archive_path: str | None = None) -> Path:
    """`rev`'s package (or the tar of it at `archive_path`) as
    dest/kvserve_base, and this bench's code importing it."""
    if archive_path is not None:
        archive = Path(archive_path).read_bytes()
    else:
        archive = subprocess.run(["git", "archive", rev, "kvserve"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "kvserve").rename(dest / "kvserve_base")
    for path in (dest / "kvserve_base").rglob("*.py"):
        path.write_text(_PACKAGE.sub("kvserve_base", path.read_text()))
    bench = dest / "host_step_bench_base.py"
    bench.write_text(_PACKAGE.sub("kvserve_base", (ROOT / "benchmarks" / "host_step_bench.py").read_text()))
    return bench


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Side:
    """One version's engine, decoding `n` requests, with its step timer."""

    def __init__(self, bench: ModuleType, a: argparse.Namespace, n: int) -> None:
        self.bench = bench
        # Built as built: `sides` sets both up as served once both exist, then
        # prepares them step by step in turn. Set up one by one, an A/A comparison
        # read 0.90-0.93; set up at once but prepared one after the other, the side
        # prepared second read 0.95-0.98 (as built, 0.96-1.04).
        self.engine = bench.build_engine(argparse.Namespace(**{**vars(a), "as_built": True}), n)
        self.timer = bench.StepTimer()
        bench.instrument(self.engine, self.timer)
        self.samples: list[dict[str, int]] = []
        # `--leave-per-step`: both sides abort the same rows (one seed), untimed, before each step.
        self.leave_per_step, self.rng = a.leave_per_step, random.Random(1)

    def step(self) -> None:
        self.bench.leave(self.engine, self.leave_per_step, self.rng)
        sample = self.bench.timed_step(self.engine, self.core, self.timer)
        sample["host_total"] = sum(sample[part] for part in self.bench.HOST_PARTS)
        self.samples.append(sample)


def compare(base: Side, new: Side, steps: int) -> None:
    for i in range(steps):
        for side in ((base, new) if i % 2 == 0 else (new, base)):
            side.step()
    print(f"{'part':12s} {'base us':>9s} {'new us':>9s} {'new/base':>9s}")
    for part in PARTS:
        b = statistics.median(s[part] for s in base.samples) / 1e3
        w = statistics.median(s[part] for s in new.samples) / 1e3
        ratio = statistics.median(x[part] / max(y[part], 1) for x, y in zip(new.samples, base.samples))
        print(f"{part:12s} {b:9.1f} {w:9.1f} {ratio:9.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree against")
    parser.add_argument("--base-archive", help="`git archive BASE kvserve` output, for a tree without that commit")
    parser.add_argument("--real-forward", action="store_true")
    known, rest = parser.parse_known_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_step_bench as new_bench
    a = new_bench.parse_args(rest)
    a.stub_forward = a.stub_forward or not known.real_forward
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        base_bench = load(export_base(known.base, Path(tmp), known.base_archive), "host_step_bench_base")
        for n in (int(x) for x in a.running.split(",")):
            print(f"running={n} steps={a.steps} base={known.base} new=working tree (medians; ratio: median "
                  f"of per-step new/base)")
            compare(*sides(base_bench, new_bench, a, n), a.steps)


def sides(base_bench: ModuleType, new_bench: ModuleType, a: argparse.Namespace, n: int) -> tuple[Side, Side]:
    """Both engines built, then set up as served (unless `--as-built`), then
    given their requests and warmed up, a step of each in turn."""
    base, new = Side(base_bench, a, n), Side(new_bench, a, n)
    if not a.as_built:
        for side in (base, new):
            new_bench.set_up_as_served(side.engine)
    steps = {side: side.bench.preparation(side.engine, a, n) for side in (base, new)}
    while steps:   # one step of each in turn, until both are decoding and warmed up
        for side in list(steps):
            core = next(steps[side], None)
            if core is None:
                del steps[side]
            else:
                side.core = core
    for side in (base, new):   # `--finish-per-step`: the same limits on both sides (one seed)
        side.bench.stagger_limits(side.engine, a.finish_per_step)
    return base, new


if __name__ == "__main__":
    main()
