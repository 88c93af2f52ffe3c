"""Score per module from `mutmut results --all true` output (mutation_test.sh).

A mutant is killed when a test failed (or it timed out); "survived" and
"no tests" (no selected test runs the mutated function) count against the
score; "skipped"/"not checked" mutants were not run and are listed apart.
"""
from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict

KILLED = {"killed", "timeout", "segfault", "suspicious"}
LINE = re.compile(r"^\s*([\w.]+)__mutmut_(\d+): (.+)$")


def module_of(name: str) -> str:
    """kvserve.cache.block_pool.xǁBlockPoolǁfree_blocks -> kvserve.cache.block_pool"""
    parts = name.split(".")
    return ".".join(p for p in parts if not p.startswith(("x_", "xǁ")))


def main(path: str) -> None:
    status: dict[str, Counter] = defaultdict(Counter)
    survivors: list[str] = []
    for line in open(path, encoding="utf-8"):
        match = LINE.match(line)
        if not match:
            continue
        name, num, result = match.groups()
        status[module_of(name)][result.strip()] += 1
        if result.strip() in ("survived", "no tests"):
            survivors.append(f"{name}__mutmut_{num}: {result.strip()}")
    print("| module | mutants | killed | survived | no tests | not run | score |")
    print("|---|---|---|---|---|---|---|")
    for module in sorted(status):
        c = status[module]
        killed = sum(c[k] for k in KILLED)
        judged = killed + c["survived"] + c["no tests"]
        not_run = sum(c.values()) - judged
        score = f"{killed / judged:.1%}" if judged else "-"
        print(f"| {module} | {sum(c.values())} | {killed} | {c['survived']} | {c['no tests']} | {not_run} | {score} |")
    print(f"\n{len(survivors)} surviving mutants:")
    print("\n".join(survivors))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results.txt")
