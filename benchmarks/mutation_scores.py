"""Score per module from `mutmut results --all true` output (mutation_test.sh).

A mutant is killed when a test failed (or it timed out); "survived" and
"no tests" (no selected test runs the mutated function) count against the
score; "skipped"/"not checked" mutants were not run and are listed apart.

    python mutation_scores.py RESULTS [SAMPLE]

With SAMPLE (a file of mutant names, one a line: mutation_sample.py) only
those mutants count, and each score comes with a 95 % Wilson interval for
the score of all the module's mutants (the sample taken as uniform; the
finite-population correction is left out, so the interval is a little wide).
"""
from __future__ import annotations

import math
import re
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "segfault", "suspicious"}
LINE = re.compile(r"^\s*([\w.ǁ]+)__mutmut_(\d+): (.+)$")
Z95 = 1.959964


def module_of(name: str) -> str:
    """kvserve.cache.block_pool.xǁBlockPoolǁfree_blocks -> kvserve.cache.block_pool"""
    parts = name.split(".")
    return ".".join(p for p in parts if not p.startswith(("x_", "xǁ")))


def wilson(killed: int, judged: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion killed / judged."""
    if judged == 0:
        return 0.0, 1.0
    p = killed / judged
    centre = (p + z * z / (2 * judged)) / (1 + z * z / judged)
    half = z * math.sqrt(p * (1 - p) / judged + z * z / (4 * judged * judged)) / (1 + z * z / judged)
    return max(0.0, centre - half), min(1.0, centre + half)


def read(path: str, only: set[str] | None) -> tuple[dict[str, Counter], list[str]]:
    status: dict[str, Counter] = defaultdict(Counter)
    survivors: list[str] = []
    for line in open(path, encoding="utf-8"):
        match = LINE.match(line)
        if not match:
            continue
        name, num, result = match.groups()
        full = f"{name}__mutmut_{num}"
        if only is not None and full not in only:
            continue
        status[module_of(name)][result.strip()] += 1
        if result.strip() in ("survived", "no tests"):
            survivors.append(f"{full}: {result.strip()}")
    return status, survivors


def row(label: str, c: Counter, with_interval: bool) -> str:
    killed = sum(c[k] for k in KILLED)
    judged = killed + c["survived"] + c["no tests"]
    score = f"{killed / judged:.1%}" if judged else "-"
    if with_interval and judged:
        low, high = wilson(killed, judged)
        score += f" [{low:.1%}, {high:.1%}]"
    return (f"| {label} | {sum(c.values())} | {killed} | {c['survived']} | {c['no tests']} "
            f"| {sum(c.values()) - judged} | {score} |")


def main(path: str, sample_path: str | None = None) -> None:
    only = None
    if sample_path is not None:
        with open(sample_path, encoding="utf-8") as lines:
            only = {line.strip() for line in lines if line.strip()}
    status, survivors = read(path, only)
    sampled = only is not None
    score_head = "score [95 % CI]" if sampled else "score"
    print(f"| module | mutants{' sampled' if sampled else ''} | killed | survived | no tests | not run | {score_head} |")
    print("|---|---|---|---|---|---|---|")
    for module in sorted(status):
        print(row(module, status[module], sampled))
    if len(status) > 1:
        print(row("all", sum(status.values(), Counter()), sampled))
    print(f"\n{len(survivors)} surviving mutants:")
    print("\n".join(survivors))


if __name__ == "__main__":
    main(*sys.argv[1:3]) if len(sys.argv) > 1 else main("results.txt")
