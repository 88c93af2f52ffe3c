"""Host µs an eager step spends choosing the Gluon prefill kernel's launch: the work list planned
(`plan_tiles`, what every eager step did before 554c147) against its items counted and the choice
made (`count_tiles` + `takes_list`, what every step does now before planning the list it takes).
Qwen3-8B heads (GQA group 4), rows of 16+ query tokens, the steps of `prefill_fa3_ab.py`.

    python benchmarks/tile_plan_cost.py
"""
from __future__ import annotations

import timeit

from kvserve.attention.kernels import prefill_gluon as pg

DECODES = [(899, 1)] * 128
STEPS = {"9 x 900": [(0, 900)] * 9, "8 x 1024": [(0, 1024)] * 8, "40 x 200 after 700": [(700, 200)] * 40,
         "1 x 8192": [(0, 8192)], "40 x 200 after 700 + 128 decodes": [(700, 200)] * 40 + DECODES}


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
