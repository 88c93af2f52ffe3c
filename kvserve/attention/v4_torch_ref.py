"""DeepSeek V4 attention in plain torch (any device): window pooling of the
compressors, the Lightning Indexer's top-k, and sliding + compressed
attention with per-head sinks, for the queries of one sequence.

Tie rule of the indexer's top-k: among equal scores the earlier entry wins
(a stable descending sort). torch.topk breaks ties by the length of the
vector it is given, which makes transformers' V4 depend on future tokens
(docs/deepseek_v4.md); a fixed rule keeps a query's output a function of
its own prefix, whatever the chunking.
"""
from __future__ import annotations

import torch


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, first_pos: int, windows: range, rate: int,
                 overlap: bool, bias: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of compressor inputs into one entry per window.

    kv/gate [R, C] hold the projections of positions first_pos..first_pos+R-1.
    Window w pools positions [w*rate, (w+1)*rate); with `overlap` (CSA) C = 2d
    and entry w also pools window w-1's first half of the channels (Ca) next
    to window w's second half (Cb). Returns [len(windows), d] before norm/rope.
    """
    if len(windows) == 0:
        return kv.new_zeros((0, kv.shape[-1] // (2 if overlap else 1)))
    w = torch.tensor(list(windows), device=kv.device)
    offsets = torch.arange(rate, device=kv.device)
    rows = (w * rate - first_pos)[:, None] + offsets  # [W, rate]
    cur_kv, cur_gate = kv[rows], gate[rows] + bias
    if not overlap:
        return _weighted(cur_kv, cur_gate)
    d = kv.shape[-1] // 2
    prev_rows = (rows - rate).clamp(min=0)
    prev_kv, prev_gate = kv[prev_rows][..., :d], (gate[prev_rows] + bias)[..., :d]
    prev_gate = prev_gate.masked_fill((w == 0)[:, None, None], float("-inf"))  # no window before 0
    prev_kv = prev_kv.masked_fill((w == 0)[:, None, None], 0.0)
    return _weighted(torch.cat([prev_kv, cur_kv[..., d:]], 1), torch.cat([prev_gate, cur_gate[..., d:]], 1))


def _weighted(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)


def visible_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """[n, E] bool: entry w is visible to a query at p when its window ends at or before p."""
    ends = (torch.arange(num_entries, device=positions.device) + 1) * rate - 1
    return ends[None, :] <= positions[:, None]


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """Lightning Indexer: sum_h w_h * ReLU(q_h . k) / sqrt(d); q [n, H, d], keys [E, d], w [n, H]."""
    scores = torch.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (scores * head_weights.float()[..., None]).sum(dim=1)


def top_k_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """[n, E] bool: the k best visible entries per query (ties: earlier entry first)."""
    ranked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros_like(visible)
    chosen.scatter_(1, order, True)
    return chosen & visible


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Softmax over the masked keys plus one sink logit per head; K = V.

    q [n, H, d], keys [K, d], mask [n, K] (True = attend), sinks [H] -> [n, H, d].
    """
    logits = torch.einsum("nhd,kd->nhk", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    # The float32 sinks promote the logits (as transformers' torch.cat does in bf16).
    sink = sinks[None, :, None].expand(q.shape[0], -1, 1)
    dtype = torch.promote_types(logits.dtype, sink.dtype)
    combined = torch.cat([logits.to(dtype), sink.to(dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.einsum("nhk,kd->nhd", probs.to(keys.dtype), keys)
