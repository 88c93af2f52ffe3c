"""Host µs an eager step spends choosing the Gluon prefill kernel's launch: the work list planned
(`plan_tiles`, what every eager step did before 554c147) against its items counted and the choice
made (`count_tiles` + `takes_list`, what every step does now before planning the list it takes).
Qwen3-8B heads (GQA group 4), rows of 16+ query tokens, the steps of `prefill_fa3_ab.py` (its list).

    python benchmarks/tile_plan_cost.py
"""
from __future__ import annotations

import sys
import timeit
from pathlib import Path

from kvserve.attention.kernels import prefill_gluon as pg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_fa3_ab import STEPS  # noqa: E402


def main(calls: int = 2000) -> None:
    print("| step | list taken | plan_tiles µs | count_tiles + takes_list µs |\n|---|---|---|---|")
    for label, rows in STEPS.items():
        q, s = [n for _, n in rows], [p + n for p, n in rows]
        taken = pg.takes_list(max(q), len(q), 4, pg.count_tiles(q, 4, 16))
        plan = timeit.timeit(lambda: pg.plan_tiles(q, s, 4, 16), number=calls) / calls * 1e6
        choose = timeit.timeit(lambda: pg.takes_list(max(q), len(q), 4, pg.count_tiles(q, 4, 16)),
                               number=calls) / calls * 1e6
        print(f"| {label} | {'yes' if taken else 'no'} | {plan:.1f} | {choose:.1f} |")


if __name__ == "__main__":
    main()
