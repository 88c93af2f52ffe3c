"""A large eager step's attention: kvserve's kernels (`mixed_attention`, as the backend calls it for
a step of its own K/V) against FlashAttention 3 as vLLM 0.26.0 calls it (`flash_attn_varlen_func`
over the paged cache, one launch for prompt and decode rows alike), on the same cache and inputs.

Profiled kernel by kernel (`scenario_profile.py`, ide-completion, one H100), the prefill steps'
attention was the one place kvserve's kernels took clearly longer than vLLM's: 235.6 ms (the Gluon
prefill kernel's 190.6 plus the decode kernel's 45.1 for the steps' one-query rows) against FA3's
146.3. The steps here are that scenario's shapes (~200-token chunks after ~700-token cached file
prefixes, whole ~900-token prompts, decode rows beside them) and a few of `tma_kernel_ab.py`'s.
Qwen3-8B heads (32 / 8, 128), bf16, block size 16. Each row prints kvserve's time as the backend
launches it (the Gluon kernel over its work list where `takes_list` says so, else its full grid),
over the full grid, over the list in either `plan_tiles` order (both forced), FA3's (n/a without
vLLM's site), kvserve's over FA3's, and the outputs' largest relative difference to FA3's (else
to the rows-order list's).

    PYTHONPATH=$PWD:$PWD/.vsite python3 benchmarks/prefill_fa3_ab.py    # vLLM's site (.vsite) holds FA3
"""
from __future__ import annotations

import torch

from kvserve.attention.kernels.mixed import mixed_attention, short_chunk_bound
from kvserve.attention.kernels import prefill_gluon
from kvserve.attention.kernels.prefill_gluon import plan_tiles
from prefill_headroom import HEAD_DIM
from tma_kernel_ab import step_inputs, timed_us

DECODES = [(899, 1)] * 128   # one-query rows at ~900 keys, as the scenario's decodes beside its prefill
# The grid launches 1.0x to 17x the list's programs across these steps ("grid/list" in each row);
# 32 and 96 decodes put two steps between 1x and the 4.2x of 128 (`LIST_MIN_SAVING` is 4).
STEPS = {"9 x 900": [(0, 900)] * 9, "40 x 200 after 700": [(700, 200)] * 40,
         "40 x 200 after 700 + 32 decodes": [(700, 200)] * 40 + DECODES[:32],
         "40 x 200 after 700 + 96 decodes": [(700, 200)] * 40 + DECODES[:96],
         "40 x 200 after 700 + 128 decodes": [(700, 200)] * 40 + DECODES,
         "20 x 200 after 700 + 4 x 900 + 128 decodes": [(700, 200)] * 20 + [(0, 900)] * 4 + DECODES,
         "32 x 64 after 700": [(700, 64)] * 32, "8 x 1024": [(0, 1024)] * 8, "1 x 8192": [(0, 8192)],
         "4 x 512 after 1504": [(1504, 512)] * 4}


def fa3():
    """vLLM's FA3 entry point, or None without vLLM's site on the path."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def work_list(rows: list[tuple[int, int]], group: int, order: str = "rows"):
    """The backend's `tile_list` for this step: the Gluon kernel's items for rows of n+ tokens."""
    query_lens, seq_lens = [n for _, n in rows], [p + n for p, n in rows]
    made = {}   # planned and uploaded once, as the backend does once a step

    def tiles(n: int) -> torch.Tensor:
        if n not in made:
            made[n] = torch.from_numpy(plan_tiles(query_lens, seq_lens, group, n, order=order)).cuda()
        return made[n]
    return tiles


def grid_over_list(rows: list[tuple[int, int]], group: int) -> float:
    """The full grid's programs over the list's (rows of 2+ query tokens), `takes_list`'s ratio."""
    query_lens = [n for _, n in rows]
    grid = prefill_gluon.grid_items(max(query_lens), len(rows), group)
    return grid / max(prefill_gluon.count_tiles(query_lens, group, 2), 1)


def always_listed(run):
    """`run` with the launch's choice between list and grid (`takes_list`) set to the list."""
    def forced():
        saved, prefill_gluon.LIST_MIN_SAVING = prefill_gluon.LIST_MIN_SAVING, 0
        try:
            return run()
        finally:
            prefill_gluon.LIST_MIN_SAVING = saved
    return forced


def compare(label: str, rows: list[tuple[int, int]], flash) -> None:
    torch.manual_seed(0)
    q, k, v, cache, table, starts, lens, top = step_inputs(rows)
    prefixes = any(p for p, n in rows if n > 1)
    scale, longest = HEAD_DIM ** -0.5, int(lens.max())
    outs = [torch.full_like(q, float("nan")) for _ in range(5)]
    paged_below = short_chunk_bound(q, cache, prefixes)
    group = q.shape[1] // cache.shape[3]

    def kvserve(out, tile_list):
        return lambda: mixed_attention(q, cache, out, table, starts, lens, top, longest, scale, None, 0,
                                       fresh_kv=(k, v), cached_prefixes=prefixes, paged_below=paged_below,
                                       tile_list=tile_list)
    runs = [kvserve(outs[0], work_list(rows, group)), kvserve(outs[1], None),
            always_listed(kvserve(outs[2], work_list(rows, group, order="keys"))),
            always_listed(kvserve(outs[3], work_list(rows, group, order="rows")))]
    if flash is not None:
        runs.append(lambda: flash(q, cache[0], cache[1], max_seqlen_q=top, cu_seqlens_q=starts,
                                  max_seqlen_k=longest, seqused_k=lens, softmax_scale=scale, causal=True,
                                  block_table=table, out=outs[4], fa_version=3))
    for run in runs:
        run()
    ref = outs[len(runs) - 1].float()   # FA3's, else the rows-order list's
    diff = max(((out.float() - ref).norm() / ref.norm()).item() for out in outs[:4])
    us = [timed_us(run) for run in runs] + [float("nan")] * (5 - len(runs))
    print(f"{label:<44} kvserve {us[0]:7.1f}  grid {us[1]:7.1f}  list/keys {us[2]:7.1f}  list/rows {us[3]:7.1f}  "
          f"FA3 {us[4]:7.1f} us  kvserve/FA3 {us[0] / us[4]:.3f}  rel diff {diff:.1e}  "
          f"grid/list {grid_over_list(rows, group):.1f}x", flush=True)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    flash = fa3()
    if flash is None:
        print("no vLLM site on the path: FA3 not timed")
    for label, rows in STEPS.items():
        try:
            compare(label, rows, flash)
        except Exception as e:  # noqa: BLE001 - a shape that fails is a row
            print(f"{label:<44} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
