"""V4 attention layer: q LoRA, one shared K=V head with partial RoPE, a sliding
window, per-head sinks, and (per layer type) a compressor of the past:
CSA (overlapping windows + Lightning Indexer top-k) or HCA (all entries).

Two paths compute the same thing. `forward`: one sequence's new tokens
against a `SequenceKV` past (state.py), the math in
`kvserve.attention.v4_torch_ref` (any device; the reference). `forward_paged`:
every token of a batch at once on the paged storage with the Triton kernels
(`kernels/`), which write the step's rows and entries in place.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention import v4_torch_ref as ref
from kvserve.model.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from kvserve.model.deepseek_v4.layers import RMSNorm, unweighted_rms_norm
from kvserve.model.deepseek_v4.rope import V4Rope, apply_rope


class Compressor(nn.Module):
    """Per-token (kv, gate) projections pooled into one entry per `rate` tokens."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)
        self.rate, self.overlap, self.dim = rate, overlap, dim

    @property
    def width(self) -> int:
        return self.wkv.out_features

    def new_entries(self, raw: tuple[torch.Tensor, torch.Tensor, int], p0: int, p_end: int,
                    rope: V4Rope) -> torch.Tensor:
        """Entries of the windows that close within [p0, p_end), normed and roped."""
        kv, gate, first = raw
        windows = range(p0 // self.rate, p_end // self.rate)
        pooled = ref.pool_windows(kv, gate, first, windows, self.rate, self.overlap, self.ape)
        if not len(windows):
            return pooled
        cos, sin = rope.cos_sin("compress", torch.tensor(list(windows), device=kv.device) * self.rate,
                                pooled.dtype)
        return apply_rope(self.norm(pooled), cos, sin)


class Indexer(nn.Module):
    """Lightning Indexer: its own compressor at index_head_dim, ReLU-weighted scores."""

    def __init__(self, config: DeepseekV4Config, rate: int) -> None:
        super().__init__()
        self.n_heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(config.hidden_size, self.dim, rate, True, config.rms_norm_eps)

    def query(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries [n, heads, dim] (roped by the compress rope's cos/sin;
        `fused`: in one Triton launch) and float32 head weights [n, heads]."""
        q = self.wq_b(q_residual).view(len(x), self.n_heads, self.dim)
        q = _rotate(q, cos, sin, fused)
        return q, self.weights_proj(x).float() * self.n_heads ** -0.5

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor, rope: V4Rope) -> torch.Tensor:
        q, weights = self.query(x, q_residual, *rope.cos_sin("compress", positions, x.dtype))
        return ref.top_k_mask(ref.index_scores(q, keys, weights), visible, self.topk)


class V4Attention(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx, self.layer_type = layer_idx, c.layer_types[layer_idx]
        self.n_heads, self.dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.o_groups, self.rope_kind = c.o_groups, "main" if self.layer_type == SLIDING else "compress"
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, self.dim, bias=False)
        self.norm = RMSNorm(self.dim, c.rms_norm_eps)
        self.wo_a = nn.Linear(self.n_heads * self.dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.eps = c.rms_norm_eps
        self.rate = c.compress_rate(self.layer_type) if self.layer_type != SLIDING else 0
        self.compressor = (Compressor(c.hidden_size, self.dim, self.rate, self.layer_type == CSA, c.rms_norm_eps)
                           if self.rate else None)
        self.indexer = Indexer(c, self.rate) if self.layer_type == CSA else None

    def compressors(self) -> dict[str, Compressor]:
        """Named compressors of this layer ("compressor", "indexer")."""
        found = {"compressor": self.compressor} if self.compressor is not None else {}
        if self.indexer is not None:
            found["indexer"] = self.indexer.compressor
        return found

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_store, rope: V4Rope) -> torch.Tensor:
        """x [n, hidden] of one sequence's new tokens at consecutive positions."""
        p0, p_end = int(positions[0]), int(positions[-1]) + 1
        cos, sin = rope.cos_sin(self.rope_kind, positions, x.dtype)
        q_residual, q, kv = self._project(x, cos, sin)
        comps = self.compressors()
        past = kv_store.past(self.layer_idx, tuple(comps), kv,
                             {n: (c.width, c.dim) for n, c in comps.items()})
        raw_new = {n: (c.wkv(x), c.wgate(x)) for n, c in comps.items()}
        new_entries = {n: c.new_entries(_joined(past.raw[n], raw_new[n]), p0, p_end, rope)
                       for n, c in comps.items()}
        keys, mask = self._keys_and_mask(x, q_residual, positions, past, kv, new_entries, rope)
        out = ref.sink_attention(q, keys, mask, self.attn_sink, self.dim ** -0.5)
        kv_store.append(self.layer_idx, kv, raw_new, new_entries)
        return self._output(out, cos, sin)

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, batch, rope: V4Rope) -> torch.Tensor:
        """x [T, hidden]: every token of the batch (`V4PagedBatch`), through the
        Triton kernels. The step's sliding keys, compressor state and entries
        are written to the pages before the attention reads them."""
        from kvserve.model.deepseek_v4 import kernels
        cos, sin = _step_rope(batch, rope, self.rope_kind, x.dtype)
        q_residual, q, kv = self._project_fused(x, cos, sin)
        sliding = batch.page("sliding", self.layer_idx)
        kernels.write_rows(kv, sliding, batch)
        entries = self._compress_paged(x, batch, rope) if self.compressor is not None else None
        indices = None
        if self.indexer is not None:
            q_index, weights = self.indexer.query(x, q_residual, *_step_rope(batch, rope, "compress", x.dtype),
                                                  fused=True)
            indices = kernels.index_top_k(q_index, weights, entries, self.dim, batch, self.rate, self.indexer.topk)
        out = kernels.sparse_attention(q, sliding, entries, indices, self.attn_sink, self.dim ** -0.5, self.window,
                                       self.rate, batch, torch.empty_like(q))
        return self._output(out, cos, sin, fused=True)

    def _compress_paged(self, x: torch.Tensor, batch, rope: V4Rope):
        """Store the step's raw compressor rows, then pool the windows it closes
        into entry pages (compressor entry, then indexer key: the torch path's
        row layout). Returns the entry pages."""
        from kvserve.model.deepseek_v4 import kernels
        kind = "csa" if self.layer_type == CSA else "hca"
        state, entries = batch.page(f"{kind}_state", self.layer_idx), batch.page(f"{kind}_entries", self.layer_idx)
        comps = list(self.compressors().values())
        kernels.write_rows(torch.cat([t for c in comps for t in (c.wkv(x), c.wgate(x))], dim=-1), state, batch)
        cos, sin = _window_rope(batch, rope, self.rate, x.dtype)
        kv_col, out_col = 0, 0
        for c in comps:
            kernels.compress(state, entries, batch, (kv_col, kv_col + c.width, out_col), c.rate, c.overlap, c.ape,
                             c.norm.weight, c.norm.eps, cos, sin)
            kv_col, out_col = kv_col + 2 * c.width, out_col + c.dim
        return entries

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q LoRA residual, roped queries [n, heads, dim], roped K=V [n, dim])."""
        q_residual = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(len(x), self.n_heads, self.dim), self.eps)
        return q_residual, apply_rope(q, cos, sin), apply_rope(self.norm(self.wkv(x)), cos, sin)

    def _project_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`_project` with each norm (+ rope) in one Triton launch (kernels/norm_rope.py)."""
        from kvserve.model.deepseek_v4.kernels.norm_rope import UNWEIGHTED, WEIGHTED, norm_rope, rms_norm
        q_residual = rms_norm(self.wq_a(x), self.q_norm.weight, self.q_norm.eps)
        q = self.wq_b(q_residual).view(len(x), self.n_heads, self.dim)
        q = norm_rope(q, cos, sin, UNWEIGHTED, eps=self.eps)
        return q_residual, q, norm_rope(self.wkv(x), cos, sin, WEIGHTED, self.norm.weight, self.norm.eps)

    def _output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
        out = _rotate(out, cos, sin, fused, inverse=True)  # undo the rotation V picked up (K = V)
        grouped = out.reshape(len(out), self.o_groups, -1)
        weight = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])
        return self.wo_b(torch.einsum("ngi,goi->ngo", grouped, weight).flatten(1))

    def _keys_and_mask(self, x, q_residual, positions, past, kv, new_entries, rope):
        keys = torch.cat([past.sliding_kv, kv])
        key_pos = torch.arange(past.sliding_start, past.sliding_start + len(keys), device=x.device)
        mask = (key_pos[None, :] <= positions[:, None]) & (positions[:, None] - key_pos[None, :] < self.window)
        if self.compressor is None:
            return keys, mask
        entries = torch.cat([past.entries["compressor"], new_entries["compressor"]])
        visible = ref.visible_entries(positions, len(entries), self.rate)
        if self.indexer is not None:
            index_keys = torch.cat([past.entries["indexer"], new_entries["indexer"]])
            visible = self.indexer.select(x, q_residual, positions, index_keys, visible, rope)
        return torch.cat([keys, entries]), torch.cat([mask, visible], dim=1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool, inverse: bool = False) -> torch.Tensor:
    """apply_rope (back, with `inverse`); `fused`: one Triton launch instead of ~10 torch ops."""
    if fused:
        from kvserve.model.deepseek_v4.kernels.norm_rope import norm_rope
        return norm_rope(x, cos, sin, inverse=inverse)
    return apply_rope(x, cos, -sin if inverse else sin)


def _step_rope(batch, rope: V4Rope, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of a rope kind at the batch's positions, computed once per
    forward and shared by its layers (forward_paged's positions are the batch's)."""
    key = ("rope", kind, dtype)
    if key not in batch.scratch:
        batch.scratch[key] = rope.cos_sin(kind, batch.positions, dtype)
    return batch.scratch[key]


def _window_rope(batch, rope: V4Rope, rate: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress-rope cos/sin at the start of the window each token closes
    (whether or not it closes one), shared by a step's layers of one rate."""
    key = ("window_rope", rate, dtype)
    if key not in batch.scratch:
        batch.scratch[key] = rope.cos_sin("compress", ((batch.positions + 1) // rate - 1) * rate, dtype)
    return batch.scratch[key]


def _joined(past: tuple[torch.Tensor, torch.Tensor, int],
            new: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    return torch.cat([past[0], new[0]]), torch.cat([past[1], new[1]]), past[2]
