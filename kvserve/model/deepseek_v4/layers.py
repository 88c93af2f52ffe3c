"""V4 building blocks other than attention: RMS norms, mHC hyper-connections
(Sinkhorn-normalized stream mixing) and the hyper head, and the MoE (hash-routed
or top-k routed experts with a shared expert and a SwiGLU clamp).

Parameter names follow the DeepSeek checkpoint (`wq_a`, `hc_attn_fn`, `ffn.gate.tid2eid`, ...),
so loading is a name normalisation, not a translation table per tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.deepseek_v4.config import DeepseekV4Config


class RMSNorm(nn.Module):
    """Weighted RMS norm; the weight stays float32 and the product is cast once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           config: DeepseekV4Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights for one block from streams [T, hc, D]: (post [T, hc], comb
    [T, hc, hc] made doubly stochastic by Sinkhorn, collapsed block input [T, D])."""
    hc, eps = config.hc_mult, config.hc_eps
    mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), config.rms_norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """New streams: post-weighted block output plus comb^T-mixed residual streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the hc streams [T, hc, D] -> [T, D]."""
    mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SwiGLU(nn.Module):
    """w2(silu(clamp(w1 x)) * clamp(w3 x)): the shared expert."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_clamped_glu(self.w1(x), self.w3(x), self.limit))


def _clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class Gate(nn.Module):
    """Router: learned scores; experts chosen by `tid2eid[token]` (hash layers)
    or by top-k of scores + correction bias; weights renormalised and scaled.
    Tensor ops only: routing never reads back to the host."""

    def __init__(self, config: DeepseekV4Config, is_hash: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.is_hash, self.top_k = is_hash, config.num_experts_per_tok
        self.func, self.scale = config.scoring_func, config.routed_scaling_factor
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _score(F.linear(x, self.weight), self.func)
        if self.is_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            indices = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices

    def forward_fused(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with everything after the GEMM in one Triton launch (kernels/router.py)."""
        from kvserve.model.deepseek_v4.kernels.router import route_tokens
        logits = F.linear(x, self.weight)
        if self.is_hash:
            return route_tokens(logits, self.func, self.top_k, self.scale, input_ids=input_ids, tid2eid=self.tid2eid)
        return route_tokens(logits, self.func, self.top_k, self.scale, bias=self.bias)


class MoE(nn.Module):
    """Routed experts (stacked weights) + shared expert. The router's glue and
    the routed experts run as Triton kernels (kernels/router.py, kernels/moe.py:
    no host sync, CUDA-graph safe) on CUDA, or wherever `backend` is "triton"
    (the CPU under TRITON_INTERPRET=1);
    elsewhere as a torch loop over the experts hit, the reference path."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Gate(config, config.mlp_layer_types[layer_idx] == "hash_moe")
        self.w1 = nn.Parameter(torch.empty(e, i, h))
        self.w3 = nn.Parameter(torch.empty(e, i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = SwiGLU(h, i, config.swiglu_limit)  # as transformers: one expert wide
        self.limit = config.swiglu_limit
        self.backend: str | None = None  # "triton", "torch"; None: "triton" on CUDA

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if (self.backend or ("triton" if x.is_cuda else "torch")) == "triton":
            from kvserve.model.deepseek_v4.kernels.moe import fused_moe
            weights, indices = self.gate.forward_fused(x, input_ids)
            routed = fused_moe(x, self.w1, self.w3, self.w2, weights, indices, self.limit)
        else:
            weights, indices = self.gate(x, input_ids)
            routed = self.routed_reference(x, weights, indices)
        return routed + self.shared_experts(x)

    def routed_reference(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts one expert at a time (reads the experts hit back to the host)."""
        out = torch.zeros_like(x)
        for expert in indices.unique().tolist():
            token, slot = torch.where(indices == expert)
            h = _clamped_glu(F.linear(x[token], self.w1[expert]), F.linear(x[token], self.w3[expert]), self.limit)
            out.index_add_(0, token, (F.linear(h, self.w2[expert]) * weights[token, slot, None]).to(x.dtype))
        return out
