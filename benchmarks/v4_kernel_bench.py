"""DeepSeek V4 Triton kernels on one GPU at V4-Flash attention shapes (64 heads x
512, one K=V head; indexer 64 heads x 128, top-512; window 128; CSA rate 4,
HCA rate 128; bf16 pages), against the device's measured copy bandwidth.

    python benchmarks/v4_kernel_bench.py [--quick] [--batches 1 64 256] [--contexts 4096 32768 131072]
                                         [--block-size 16] [--no-extras] [--gluon-dim-parts {1,2,auto}]
                                         [--index-keys {inline,split}]

Per decode shape (one token per sequence at `context`), each variant is
first checked against a torch reference on the same pages (attention: the
gathered window + chosen keys through v4_torch_ref.sink_attention; scores:
v4_torch_ref.index_scores on a few rows; top-k: v4_torch_ref.top_k_mask on
the kernel's own scores, exact); a variant that mismatches or fails to
compile is reported, not timed. Then:
  * the sparse decode path (index scores + top-k + CSA attention) with the
    old configs (the previous defaults) and the kernels' current defaults;
  * a grid per kernel: attention (inline / planned / prefetch rows, BLOCK_N,
    num_warps, num_stages, heads per program, splits), scores (tile, waves,
    warps, stages), top-k (radix bits, warps, tile);
  * HCA decode attention, old and default;
  * with --path-only: the default kernels and path alone, the path also as a
    CUDA graph's replay (as the engine's decode runs it: no launch gaps);
  * GB/s over the bytes the path must read (every visible indexer key, the
    512 chosen entries, the 128 window keys) and the share of a device copy
    (torch copy of 4 GiB, bytes read + written, measured in the same run).
Last: a markdown table of the best config per shape and kernel, and the path
with those (edit DECODE_CONFIGS / SCORE_CONFIG / TOP_K_CONFIG from it).
Timings: triton.testing.do_bench medians (L2 flushed between runs). The pages
hold one layer of each kind in blocks sized for the largest page of the run.
With --no-extras the compressor and prefill-chunk indexer timings are skipped.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.attention import v4_torch_ref as ref  # noqa: E402
from kvserve.bench.kernels import copy_bandwidth_gbs  # noqa: E402
from kvserve.cache.v4_specs import V4KVLayout  # noqa: E402
from kvserve.model.deepseek_v4 import kernels  # noqa: E402
from kvserve.model.deepseek_v4.kernels import PageRef, SparseAttentionConfig, V4PagedBatch  # noqa: E402
from kvserve.model.deepseek_v4.kernels import indexer  # noqa: E402
from kvserve.model.deepseek_v4.kernels.indexer import ScoreConfig, TopKConfig  # noqa: E402
from kvserve.model.deepseek_v4.kernels.sparse_attention import GLUON_CONFIG  # noqa: E402

D, DI, H, HI, TOPK, WINDOW, CSA_RATE, HCA_RATE, ROPE = 512, 128, 64, 64, 512, 128, 4, 128, 64
DTYPE, DEVICE, ELEM = torch.bfloat16, "cuda", 2
ATTN_TOL, SCORE_TOL = 1e-2, 1e-3


def _ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _ids(count: int) -> torch.Tensor:
    """Block ids 1..count in random order (pages of one sequence are scattered)."""
    return (torch.randperm(count, device=DEVICE) + 1).to(torch.int32)


class DecodePages:
    """One decode token per sequence at position context - 1: the sliding,
    CSA-entry and HCA-entry pages of one layer each, and their tables."""

    def __init__(self, batch: int, context: int, block_size: int, split_index: bool = False) -> None:
        B, slots = block_size, triton.cdiv(context, block_size)
        first_window_slot = max(0, context - WINDOW) // B
        hca_slots = [i for i in range(slots) if (i + 1) * B // HCA_RATE > i * B // HCA_RATE]
        per_seq = (slots - first_window_slot) + slots + len(hca_slots)
        self.storage = torch.empty(1 + batch * per_seq, B * D, dtype=DTYPE, device=DEVICE).normal_()
        ids = _ids(batch * per_seq).view(batch, per_seq)
        sliding = torch.zeros(batch, slots, dtype=torch.int32, device=DEVICE)
        sliding[:, first_window_slot:] = ids[:, :slots - first_window_slot]
        csa = ids[:, slots - first_window_slot:2 * slots - first_window_slot].contiguous()
        hca = torch.zeros(batch, slots, dtype=torch.int32, device=DEVICE)
        hca[:, hca_slots] = ids[:, 2 * slots - first_window_slot:]
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=DEVICE)
        seq_idx = torch.arange(batch, dtype=torch.int32, device=DEVICE)
        self.batch = V4PagedBatch(self.storage, V4KVLayout(B, B * D, ()), [sliding, csa, hca], seq_idx, positions,
                                  context)
        self.sliding = PageRef(sliding, 0, B, D)
        rows = B // CSA_RATE
        if split_index:  # a page's entries [rows x D], then their indexer keys [rows x DI]
            self.csa, self.csa_index, self.index_col = PageRef(csa, 0, rows, D), PageRef(csa, rows * D, rows, DI), 0
        else:            # the engine's layout: each entry's row [D | DI]
            self.csa = self.csa_index = PageRef(csa, 0, rows, D + DI)
            self.index_col = D
        self.hca = PageRef(hca, 0, max(1, B // HCA_RATE), D)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        self.q = torch.randn(batch, H, D, generator=g, device=DEVICE, dtype=DTYPE) * (8 / D) ** 0.5
        self.q_index = torch.randn(batch, HI, DI, generator=g, device=DEVICE, dtype=DTYPE)
        self.weights = torch.randn(batch, HI, generator=g, device=DEVICE) * HI ** -0.5
        self.sinks = torch.randn(H, generator=g, device=DEVICE)
        self.scores = torch.empty(batch, context // CSA_RATE, dtype=torch.float32, device=DEVICE)
        self.indices = torch.empty(batch, TOPK, dtype=torch.int32, device=DEVICE)
        self.out = torch.empty_like(self.q)

    def index_scores(self, config: ScoreConfig | None = None) -> None:
        kernels.index_scores(self.q_index, self.weights, self.csa_index, self.index_col, self.batch, CSA_RATE,
                             self.scores, config)

    def top_k(self, config: TopKConfig | None = None) -> None:
        kernels.top_k_indices(self.scores, self.batch, CSA_RATE, TOPK, self.indices, config)

    def attend(self, kind: str, config: SparseAttentionConfig | None = None) -> None:
        entries, indices, rate = (self.csa, self.indices, CSA_RATE) if kind == "csa" else (self.hca, None, HCA_RATE)
        kernels.sparse_attention(self.q, self.sliding, entries, indices, self.sinks, D ** -0.5, WINDOW, rate,
                                 self.batch, self.out, config)

    def csa_step(self, configs: "PathConfigs") -> None:
        self.index_scores(configs.scores)
        self.top_k(configs.top_k)
        self.attend("csa", configs.attention)


class Reference:
    """Torch references on the pages: rows gathered from the block tables."""

    def __init__(self, pages: DecodePages, context: int) -> None:
        self.pages, self.context = pages, context
        self.flat = pages.storage.view(-1)
        self.unit = pages.storage.stride(0)
        pos = context - 1
        window = torch.arange(max(0, pos - WINDOW + 1), pos + 1, device=DEVICE)
        self.window_rows = self._rows(pages.sliding, window // pages.batch.block_size,
                                      window % pages.batch.block_size)  # [batch, window]

    def _rows(self, page: PageRef, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Storage offsets [batch, n] of (table slot, row) pairs [n] or [batch, n]."""
        slots, rows = slots.expand(page.table.shape[0], -1), rows.expand(page.table.shape[0], -1)
        blocks = torch.gather(page.table, 1, slots.long()).long()
        return blocks * self.unit + page.offset + rows.long() * page.width

    def _entry_rows(self, page: PageRef, entries: torch.Tensor, rate: int) -> torch.Tensor:
        B = self.pages.batch.block_size
        return self._rows(page, ((entries + 1) * rate - 1) // B, entries % max(1, B // rate))

    def _gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        return self.flat[rows[..., None] + torch.arange(width, device=DEVICE)].float()

    def attention(self, kind: str) -> torch.Tensor:
        p = self.pages
        if kind == "csa":
            entries = p.indices.long().clamp(min=0)
            rows, chosen = self._entry_rows(p.csa, entries, CSA_RATE), p.indices >= 0
        else:
            count = self.context // HCA_RATE
            rows = self._entry_rows(p.hca, torch.arange(count, device=DEVICE)[None, :], HCA_RATE)
            chosen = torch.ones_like(rows, dtype=torch.bool)
        rows = torch.cat([self.window_rows, rows], 1)
        mask = torch.cat([torch.ones_like(self.window_rows, dtype=torch.bool), chosen], 1)
        out = torch.empty(p.q.shape, dtype=torch.float32, device=DEVICE)
        for t in range(p.q.shape[0]):
            keys = self._gather(rows[t], D)
            out[t] = ref.sink_attention(p.q[t:t + 1].float(), keys, mask[t:t + 1], p.sinks, D ** -0.5)[0]
        return out

    def scores(self, tokens: list[int]) -> torch.Tensor:
        p, count = self.pages, self.context // CSA_RATE
        rows = self._entry_rows(p.csa_index, torch.arange(count, device=DEVICE)[None, :], CSA_RATE)
        return torch.stack([ref.index_scores(p.q_index[t:t + 1].float(), self._gather(rows[t] + p.index_col, DI),
                                             p.weights[t:t + 1])[0] for t in tokens])

    def top_k(self) -> list[list[int]]:
        p, count = self.pages, self.context // CSA_RATE
        visible = torch.ones(p.scores.shape[0], count, dtype=torch.bool, device=DEVICE)
        chosen = ref.top_k_mask(p.scores[:, :count], visible, TOPK)
        return [row.nonzero().flatten().tolist() for row in chosen]


def describe(config) -> str:
    """A config by its fields that differ from the defaults ("default": the kernel's table)."""
    if config is None:
        return "default"
    changed = [f"{f.name}={getattr(config, f.name)}" for f in fields(config)
               if getattr(config, f.name) != f.default]
    return f"{type(config).__name__}({', '.join(changed)})"


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-token ||out - ref|| / ||ref|| (NaN: inf)."""
    dims = tuple(range(1, out.dim()))
    err = (out.float() - expected).norm(dim=dims) / expected.norm(dim=dims)
    return float(err.nan_to_num(float("inf")).max())


@dataclass(frozen=True)
class PathConfigs:
    scores: ScoreConfig | None = None
    top_k: TopKConfig | None = None
    attention: SparseAttentionConfig | None = None


def csa_bytes(batch: int, context: int, with_indexer: bool = True) -> int:
    entries = context // CSA_RATE
    keys = entries * DI if with_indexer else 0
    return batch * ELEM * (keys + (min(entries, TOPK) + min(context, WINDOW)) * D)


def score_bytes(batch: int, context: int) -> int:
    return batch * ELEM * (context // CSA_RATE) * DI


def hca_bytes(batch: int, context: int) -> int:
    return batch * ELEM * (context // HCA_RATE + min(context, WINDOW)) * D


def _rate(nbytes: int, ms: float, copy_gbs: float) -> str:
    gbs = nbytes / ms / 1e6
    return f"{gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}%"


def old_attention(batch: int, context: int, kind: str) -> SparseAttentionConfig:
    """The previous default: inline rows, splits for half a wave of 132 SMs, >= 128 keys a split."""
    keys = min(context, WINDOW) + (min(context // CSA_RATE, TOPK) if kind == "csa" else context // HCA_RATE)
    splits = max(1, min(triton.cdiv(66, batch), keys // 128, triton.cdiv(keys, 32), 32))
    return SparseAttentionConfig(num_splits=splits)


OLD_TOP_K = TopKConfig(candidates=False)  # the previous top-k (8-bit passes over the whole row)
OLD_SCORES = ScoreConfig(key_rows=False)  # the previous scores (heads x keys)


def attention_grid(batch: int, quick: bool) -> list[SparseAttentionConfig]:
    planned = SparseAttentionConfig(planned=True)
    shapes = [SparseAttentionConfig(), SparseAttentionConfig(num_stages=3), planned, replace(planned, num_stages=3),
              replace(planned, block_n=64), replace(planned, block_n=16, num_stages=3),
              replace(planned, prefetch=True, num_stages=1), replace(planned, prefetch=True, num_stages=1, block_n=16),
              replace(planned, block_h=32, num_warps=4, block_n=16, num_stages=3, programs_per_sm=2),
              replace(planned, block_h=32, num_warps=4, num_stages=2, programs_per_sm=2),
              replace(planned, block_h=32, num_warps=8, num_stages=3),
              replace(planned, block_h=16, num_warps=4, block_n=16, num_stages=3, programs_per_sm=3)]
    if quick:
        shapes = shapes[:1] + shapes[3:4] + shapes[6:7] + shapes[8:9]
    splits = {1: (None, 5, 10, 20), 64: (None, 1, 2, 4)}.get(batch, (None, 1, 2))
    # the Gluon kernel (Hopper; elsewhere its config's planned Triton kernel) splits nothing
    return [replace(c, num_splits=n) for c in shapes for n in splits] + [GLUON_CONFIG]


def score_grid(quick: bool) -> list[ScoreConfig]:
    grid = [ScoreConfig(), ScoreConfig(key_rows=False), ScoreConfig(block_e=128), ScoreConfig(num_stages=4),
            ScoreConfig(block_e=128, num_warps=8), ScoreConfig(block_e=128, num_stages=4), ScoreConfig(waves=8),
            ScoreConfig(block_e=32, num_stages=4), ScoreConfig(waves=2, block_e=128, num_stages=4),
            ScoreConfig(block_e=128, num_warps=8, key_rows=False)]
    return grid[:3] if quick else grid


def top_k_grid(quick: bool) -> list[TopKConfig]:
    full = TopKConfig(radix_bits=4, num_warps=16, candidates=False)  # the default before the candidate shortcut
    grid = [full, TopKConfig(radix_bits=4, max_tile=4096, num_warps=8),
            TopKConfig(radix_bits=4, max_tile=4096, num_warps=8, group_list=True), TopKConfig(radix_bits=4),
            TopKConfig(radix_bits=4, num_warps=16), TopKConfig(), TopKConfig(radix_bits=4, num_warps=8),
            TopKConfig(radix_bits=4, num_warps=4), TopKConfig(radix_bits=4, max_tile=4096, num_warps=4),
            TopKConfig(radix_bits=4, groups_per_k=2), TopKConfig(radix_bits=4, groups_per_k=2, num_warps=8),
            TopKConfig(radix_bits=4, groups_per_k=2, max_tile=4096, num_warps=4), TopKConfig(radix_bits=2)]
    return grid[:4] if quick else grid


class Shape:
    """One decode shape: references, checked timings, best configs."""

    def __init__(self, batch: int, context: int, block_size: int, copy_gbs: float,
                 split_index: bool = False) -> None:
        self.batch, self.context, self.copy_gbs = batch, context, copy_gbs
        self.tag = f"bs={batch} ctx={context // 1024}K"
        self.pages = DecodePages(batch, context, block_size, split_index)
        self.ref = Reference(self.pages, context)
        self.best: dict[str, tuple[float, object]] = {}

    def _time(self, kernel: str, config, run, check, nbytes: int) -> float | None:
        """Check (fresh poisoned output), then time; print one line."""
        try:
            bad = check(run)
        except Exception as exc:  # a config the compiler rejects (e.g. shared memory) is reported
            print(f"  {self.tag:16s} {kernel:9s} FAILED {type(exc).__name__}: {str(exc)[:120]}  {describe(config)}")
            return None
        if bad:
            print(f"  {self.tag:16s} {kernel:9s} MISMATCH {bad}  {describe(config)}")
            return None
        ms = _ms(run)
        print(f"  {self.tag:16s} {kernel:9s} {1e3 * ms:8.1f} us {_rate(nbytes, ms, self.copy_gbs)}  {describe(config)}")
        if kernel not in self.best or ms < self.best[kernel][0]:
            self.best[kernel] = (ms, config)
        return ms

    def check_scores(self, run) -> str | None:
        self.pages.scores.fill_(float("nan"))
        run()
        count, tokens = self.context // CSA_RATE, sorted({0, self.batch // 2, self.batch - 1})
        err = _rel_err(self.pages.scores[tokens, :count], self.ref.scores(tokens))
        return None if err < SCORE_TOL else f"rel err {err:.2e}"

    def check_top_k(self, run) -> str | None:
        self.pages.indices.fill_(12345)
        run()
        count = min(TOPK, self.context // CSA_RATE)
        for t, want in enumerate(self.ref.top_k()):
            got = self.pages.indices[t].tolist()
            if got != want + [-1] * (TOPK - len(want)):
                return f"token {t}: {sum(a != b for a, b in zip(got, want))} of {count} indices differ"
        return None

    def check_attention(self, kind: str, run) -> str | None:
        if not hasattr(self, f"ref_{kind}"):
            setattr(self, f"ref_{kind}", self.ref.attention(kind))
        self.pages.out.fill_(float("nan"))
        run()
        err = _rel_err(self.pages.out, getattr(self, f"ref_{kind}"))
        return None if err < ATTN_TOL else f"rel err {err:.2e}"


def bench_shape(shape: Shape, quick: bool, no_attention_grid: bool = False, path_only: bool = False) -> dict:
    """Every variant of every kernel on one shape (`path_only`: the default configs alone, each
    checked, then the default path); returns the path timings."""
    p, b, c = shape.pages, shape.batch, shape.context
    p.index_scores()  # the real scores and indices first: the checks of later kernels read them
    p.top_k()
    if path_only:
        return default_path(shape)
    for config in score_grid(quick):
        shape._time("scores", config, lambda: p.index_scores(config), shape.check_scores, score_bytes(b, c))
    p.index_scores()
    for config in top_k_grid(quick):
        shape._time("top-k", config, lambda: p.top_k(config), shape.check_top_k, 0)
    p.top_k()
    attend_bytes = csa_bytes(b, c, False)
    for config in [old_attention(b, c, "csa"), None] + ([] if no_attention_grid else attention_grid(b, quick)):
        shape._time("attention", config, lambda: p.attend("csa", config),
                    lambda run: shape.check_attention("csa", run), attend_bytes)
    for config in (old_attention(b, c, "hca"), None):
        shape._time("hca", config, lambda: p.attend("hca", config), lambda run: shape.check_attention("hca", run),
                    hca_bytes(b, c))
    shape.best.pop("hca", None)
    paths = {"old": PathConfigs(OLD_SCORES, OLD_TOP_K, old_attention(b, c, "csa")),
             "default": PathConfigs(),
             "best": PathConfigs(*(shape.best.get(k, (0, None))[1] for k in ("scores", "top-k", "attention")))}
    timings = {}
    for name, configs in paths.items():
        ms = _ms(lambda: p.csa_step(configs))
        timings[name] = ms
        print(f"  {shape.tag:16s} path {name:7s} {1e3 * ms:8.1f} us {_rate(csa_bytes(b, c), ms, shape.copy_gbs)}")
    return timings


def default_path(shape: Shape) -> dict:
    """The default configs' kernels checked and timed one by one, then the path they make."""
    p, b, c = shape.pages, shape.batch, shape.context
    shape._time("scores", None, p.index_scores, shape.check_scores, score_bytes(b, c))
    p.index_scores()
    shape._time("top-k", None, p.top_k, shape.check_top_k, 0)
    p.top_k()
    shape._time("attention", None, lambda: p.attend("csa"), lambda run: shape.check_attention("csa", run),
                csa_bytes(b, c, False))
    ms = _ms(lambda: p.csa_step(PathConfigs()))
    print(f"  {shape.tag:16s} path default {1e3 * ms:8.1f} us {_rate(csa_bytes(b, c), ms, shape.copy_gbs)}")
    graph_ms = _graph_ms(lambda: p.csa_step(PathConfigs()))
    print(f"  {shape.tag:16s} path graph   {1e3 * graph_ms:8.1f} us {_rate(csa_bytes(b, c), graph_ms, shape.copy_gbs)}")
    return {"old": float("nan"), "default": ms, "best": ms}


def _graph_ms(run) -> float:
    """`run` captured in a CUDA graph (as the engine's decode runs it), the replay timed."""
    from kvserve.runner.cuda_graph import capture_graph
    graph, _ = capture_graph(run, None, torch.cuda.Stream())
    return _ms(graph.replay)


def best_table(rows: list[tuple[Shape, dict]], copy_gbs: float) -> None:
    print("\n| shape | scores (best) | top-k (best) | attention (best) | path old | path default | path best |")
    print("|---|---|---|---|---|---|---|")
    for shape, paths in rows:
        cells = []
        for kernel in ("scores", "top-k", "attention"):
            ms, config = shape.best.get(kernel, (float("nan"), None))
            cells.append(f"{1e3 * ms:.1f} us `{describe(config)}`")
        total = csa_bytes(shape.batch, shape.context)
        cells += [f"{1e3 * ms:.1f} us, {100 * total / ms / 1e6 / copy_gbs:.1f}% of copy" for ms in paths.values()]
        print(f"| {shape.tag} | " + " | ".join(cells) + " |")


class CompressPages:
    """State and entry pages for tokens at `positions` of `batch` sequences (one
    sequence per token), every state row of their windows filled."""

    def __init__(self, seq_positions: list[torch.Tensor], block_size: int) -> None:
        B = block_size
        width = 4 * D + 4 * DI
        slots = triton.cdiv(int(max(p.max() for p in seq_positions)) + 1, B)
        n = len(seq_positions)
        self.storage = torch.empty(1 + 4 * n * slots, B * width, dtype=DTYPE, device=DEVICE).normal_()
        ids = _ids(4 * n * slots).view(4, n, slots)
        seq_idx = torch.cat([torch.full((len(p),), i, dtype=torch.int32) for i, p in enumerate(seq_positions)])
        positions = torch.cat(seq_positions)
        self.batch = V4PagedBatch(self.storage, V4KVLayout(B, B * width, ()), list(ids), seq_idx.to(DEVICE),
                                  positions.to(DEVICE), int(positions.max()) + 1)
        self.csa_state, self.csa_entries = PageRef(ids[0], 0, B, width), PageRef(ids[1], 0, B // CSA_RATE, D + DI)
        self.hca_state, self.hca_entries = PageRef(ids[2], 0, B, 2 * D), PageRef(ids[3], 0, 1, D)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        self.ape = {r: torch.randn(r, w, generator=g, device=DEVICE) for r, w in ((CSA_RATE, 2 * D), (HCA_RATE, D))}
        self.ape_index = torch.randn(CSA_RATE, 2 * DI, generator=g, device=DEVICE)
        self.norm = torch.ones(D, device=DEVICE)
        self.norm_index = torch.ones(DI, device=DEVICE)
        t = len(positions)
        self.cos = torch.rand(t, ROPE // 2, generator=g, device=DEVICE).to(DTYPE)
        self.sin = torch.rand(t, ROPE // 2, generator=g, device=DEVICE).to(DTYPE)

    def csa(self) -> None:
        args = (self.csa_state, self.csa_entries, self.batch)
        kernels.compress(*args, (0, 2 * D, 0), CSA_RATE, True, self.ape[CSA_RATE], self.norm, 1e-6, self.cos,
                         self.sin)
        kernels.compress(*args, (4 * D, 4 * D + 2 * DI, D), CSA_RATE, True, self.ape_index, self.norm_index, 1e-6,
                         self.cos, self.sin)

    def hca(self) -> None:
        kernels.compress(self.hca_state, self.hca_entries, self.batch, (0, D, 0), HCA_RATE, False,
                         self.ape[HCA_RATE], self.norm, 1e-6, self.cos, self.sin)


def bench_compressor(batch: int, block_size: int, copy_gbs: float) -> None:
    """Decode: every token closes a CSA and an HCA window (position 128k - 1)."""
    pages = CompressPages([torch.tensor([HCA_RATE * (8 + i % 8) - 1]) for i in range(batch)], block_size)
    csa, hca = _ms(pages.csa), _ms(pages.hca)
    csa_read = batch * ELEM * 2 * CSA_RATE * 2 * (D + DI)  # 2 x rate rows of kv + gate, half of each row
    hca_read = batch * ELEM * HCA_RATE * 2 * D
    print(f"compress decode bs={batch:4d} B={block_size}  CSA (entry + indexer key) {1e3 * csa:7.1f} us "
          f"{_rate(csa_read, csa, copy_gbs)}  HCA {1e3 * hca:7.1f} us {_rate(hca_read, hca, copy_gbs)}")


def bench_prefill_chunk(chunk: int, context: int, block_size: int, copy_gbs: float) -> None:
    """One sequence's chunk of `chunk` tokens ending at `context`: compressors over
    it (every window it closes) and the indexer (scores + top-k) of its queries."""
    pages = CompressPages([torch.arange(context - chunk, context)], block_size)
    csa, hca = _ms(pages.csa), _ms(pages.hca)
    print(f"compress prefill chunk={chunk} ctx={context} B={block_size}  CSA {1e3 * csa:8.1f} us  "
          f"HCA {1e3 * hca:8.1f} us")
    del pages
    decode = DecodePages(1, context, block_size)
    positions = torch.arange(context - chunk, context, device=DEVICE)
    batch = V4PagedBatch(decode.storage, decode.batch.layout, decode.batch.block_tables,
                         torch.zeros(chunk, dtype=torch.int32, device=DEVICE), positions, context)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(chunk, HI, DI, generator=g, device=DEVICE, dtype=DTYPE)
    weights = torch.randn(chunk, HI, generator=g, device=DEVICE) * HI ** -0.5
    scores = torch.empty(chunk, context // CSA_RATE, dtype=torch.float32, device=DEVICE)
    out = torch.empty(chunk, TOPK, dtype=torch.int32, device=DEVICE)
    score_ms = _ms(lambda: kernels.index_scores(q, weights, decode.csa, D, batch, CSA_RATE, scores))
    top_k_ms = _ms(lambda: kernels.top_k_indices(scores, batch, CSA_RATE, TOPK, out))
    flops = 2 * HI * DI * int(((positions + 1) // CSA_RATE).sum())
    print(f"indexer prefill chunk={chunk} ctx={context}  scores {1e3 * score_ms:8.1f} us "
          f"({flops / score_ms / 1e9:6.1f} TFLOP/s)  top-k {1e3 * top_k_ms:8.1f} us")


def gluon_module():
    return importlib.import_module("kvserve.model.deepseek_v4.kernels.sparse_decode_gluon")


def set_gluon_dim_parts(choice: str) -> str:
    """The Gluon sparse decode kernel's dim parts (programs a token) for this run: 1 or 2 for
    every launch, or `auto`, its rule with the threshold at half the SM count (the kernel reads
    its module's defaults at each launch). Returns the setting, for the run's header."""
    gluon = gluon_module()
    if choice == "auto":
        gluon.DIM_PARTS_MAX_TOKENS = gluon.sm_count(torch.device(DEVICE)) // 2
        return f"auto (2 up to {gluon.DIM_PARTS_MAX_TOKENS} tokens)"
    gluon.DIM_PARTS_FORCED = int(choice)
    return choice


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="32K only, batch 64 and 256, a few variants each")
    parser.add_argument("--no-extras", action="store_true", help="skip the compressor and prefill-chunk timings")
    parser.add_argument("--no-attention-grid", action="store_true", help="attention: the old and default configs only")
    parser.add_argument("--path-only", action="store_true",
                        help="each shape's default kernels (checked) and default path alone (as launched and as a "
                             "CUDA graph's replay): no config grids")
    parser.add_argument("--top-k-group-list", choices=("on", "off"), default=None,
                        help="the top-k's TopKConfig.group_list (compact from the listed groups only); default: "
                             "TOP_K_CONFIG's")
    parser.add_argument("--gluon-dim-parts", choices=("1", "2", "auto"), default=None,
                        help="the Gluon sparse decode kernel's dim parts (programs a token): 1 or 2 for every "
                             "launch, auto: its rule with the threshold at half the SM count; default: the module's")
    parser.add_argument("--gluon-min-tokens", type=int, default=None,
                        help="the fewest tokens the default configs give the Gluon sparse decode kernel "
                             "(GLUON_MIN_TOKENS; below it the Triton planned split kernel runs); default: the module's")
    parser.add_argument("--index-keys", choices=("inline", "split"), default="inline",
                        help="where the CSA pages keep the indexer keys: inline (the engine's: each entry's row "
                             "is [entry | indexer key]) or split (a page's entries, then their indexer keys: each "
                             "page's keys contiguous)")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--prefill-context", type=int, default=32768)
    args = parser.parse_args(argv)
    if args.top_k_group_list:  # the kernels read the module's default at each call
        indexer.TOP_K_CONFIG = replace(indexer.TOP_K_CONFIG, group_list=args.top_k_group_list == "on")
    batches = args.batches or ([64, 256] if args.quick else [1, 64, 256])
    contexts = args.contexts or ([32768] if args.quick else [4096, 32768, 131072])
    dim_parts = set_gluon_dim_parts(args.gluon_dim_parts) if args.gluon_dim_parts else "the module's default"
    if args.gluon_min_tokens is not None:   # `default_config` reads it at each call
        gluon_module().GLUON_MIN_TOKENS = args.gluon_min_tokens
        dim_parts += f"; Gluon from {args.gluon_min_tokens} tokens"
    torch.manual_seed(0)
    started = time.time()
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}; top-k config {indexer.TOP_K_CONFIG}; Gluon dim parts {dim_parts}; "
          f"block size {args.block_size}; indexer keys {args.index_keys}")
    print(f"copy bandwidth (D2D, read+write): {copy_gbs:.0f} GB/s")
    print("columns: shape, kernel, median us, GB/s over the kernel's minimum bytes (top-k: none), % of copy, config")
    rows = []
    for context in contexts:
        for batch in batches:
            shape = Shape(batch, context, args.block_size, copy_gbs, args.index_keys == "split")
            rows.append((shape, bench_shape(shape, args.quick, args.no_attention_grid, args.path_only)))
            shape.pages = shape.ref = None
            for kind in ("csa", "hca"):
                shape.__dict__.pop(f"ref_{kind}", None)
            torch.cuda.empty_cache()
            print(f"  ({time.time() - started:.0f} s)", flush=True)
    if not args.no_extras:
        for batch in (64, 256):
            bench_compressor(batch, args.block_size, copy_gbs)
        bench_prefill_chunk(args.prefill_chunk, args.prefill_context, args.block_size, copy_gbs)
    best_table(rows, copy_gbs)
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
