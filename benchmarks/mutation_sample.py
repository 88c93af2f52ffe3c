"""A uniform random sample of mutmut's mutants, for runs too long to do in full
(mutation_test.sh with MUTATION_SAMPLE=N).

Reads `mutmut results --all true` output (every generated mutant, run or not),
keeps the names matching any of the globs (all when none is given), sorts them
and draws N without replacement with `random.Random(seed)`: the same mutants,
commit and seed give the same sample on any machine.

    python mutation_sample.py RESULTS N SEED [GLOB...] > sample.txt
"""
from __future__ import annotations

import fnmatch
import random
import re
import sys

NAME = re.compile(r"^\s*([\w.ǁ]+__mutmut_\d+): ")


def mutant_names(path: str) -> list[str]:
    with open(path, encoding="utf-8") as lines:
        return sorted({m.group(1) for line in lines if (m := NAME.match(line))})


def matching(names: list[str], globs: list[str]) -> list[str]:
    return [n for n in names if not globs or any(fnmatch.fnmatch(n, g) for g in globs)]


def sample(pool: list[str], size: int, seed: int) -> list[str]:
    """`size` names drawn uniformly (all of them when there are fewer)."""
    if size < 1:
        raise ValueError(f"sample size must be >= 1, got {size}")
    if not pool:
        raise ValueError("no mutant to sample from")
    return sorted(random.Random(seed).sample(pool, min(size, len(pool))))


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    path, size, seed, globs = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    pool = matching(mutant_names(path), globs)
    chosen = sample(pool, size, seed)
    print(f"sampled {len(chosen)} of {len(pool)} mutants (seed {seed})", file=sys.stderr)
    print("\n".join(chosen))


if __name__ == "__main__":
    main(sys.argv[1:])
