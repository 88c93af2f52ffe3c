"""One config-driven decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

Owns the module tree, the forward pass over flattened tokens, and mapping HF
checkpoint names onto fused parameters (q/k/v -> qkv_proj, gate/up ->
gate_up_proj). Differences between architectures are config flags (biases,
q/k norm, tied embeddings, per-layer attention specs), never subclasses.
Attention itself is the backend's job; layers only hold their KV cache tensor.

Under tensor parallelism (a `TPGroup`) each rank builds its shard of the same
tree (`kvserve/distributed/sharding.py` says which heads and rows): qkv and
gate/up hold the rank's output rows, o_proj and down_proj are row-parallel
(one all-reduce each per layer), the embedding and LM head vocab-parallel.
Without a group the modules are the plain single-GPU ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionLayerInfo
from kvserve.attention.metadata import AttentionMetadata
from kvserve.distributed.sharding import Slice, TPShard
from kvserve.model.config import ModelConfig
from kvserve.model.fused_ops import qk_norm_rope_
from kvserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from kvserve.model.parallel_layers import embedding, lm_head, row_parallel_linear

if TYPE_CHECKING:
    from kvserve.distributed.group import TPGroup

# HF checkpoint projection -> (fused parameter, shard index within it).
_FUSED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                 "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1)}
# Checkpoint entries that carry no weights of ours (old HF rotary buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, info: AttentionLayerInfo,
                 backend: AttentionBackend, group: "TPGroup | None" = None) -> None:
        super().__init__()
        self.info = info
        self.backend = backend
        self.q_size = info.num_heads * config.head_dim  # this rank's heads
        self.kv_size = info.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, config.o_proj_bias, group)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        # Bound by the runner after it allocates the cache; not a buffer, so it
        # stays out of state_dict and may alias another layer's tensor.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound; call bind_kv_caches() before forward()")
        num_tokens = x.shape[0]
        head_dim = self.info.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.info.num_heads, head_dim)
        k = k.view(num_tokens, self.info.num_kv_heads, head_dim)
        v = v.view(num_tokens, self.info.num_kv_heads, head_dim)
        q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        eps = self.q_norm.eps if self.qk_norm else 0.0
        q, k = qk_norm_rope_(q, k, positions, inv_freq, q_weight, k_weight, eps)
        out = self.backend.forward(q, k, v, self.kv_cache, self.info, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, info: AttentionLayerInfo, backend: AttentionBackend,
                 shard: TPShard, group: "TPGroup | None" = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, info, backend, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        intermediate = shard.local_intermediate_size
        self.mlp = GatedMLP(config.hidden_size, intermediate,
                            down_proj=row_parallel_linear(intermediate, config.hidden_size, False, group))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                inv_freq: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the
        next norm adds them, so each residual add fuses into a norm kernel."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, positions, inv_freq, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """Mirrors HF's `model.` prefix so parameter names match checkpoints."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_to_group: list[int],
                 shard: TPShard, group: "TPGroup | None" = None) -> None:
        super().__init__()
        self.embed_tokens = embedding(shard, config.hidden_size, group)
        self.layers = nn.ModuleList(
            DecoderLayer(config, _layer_info(config, i, layer_to_group[i], shard), backend, shard, group)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _layer_info(config: ModelConfig, layer_idx: int, group_id: int, shard: TPShard) -> AttentionLayerInfo:
    return AttentionLayerInfo(
        layer_idx=layer_idx, group_id=group_id, spec=config.layer_specs[layer_idx],
        num_heads=shard.num_local_heads, num_kv_heads=shard.num_local_kv_heads,
        head_dim=config.head_dim, scale=config.attention_scale)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 layer_to_group: list[int], group: "TPGroup | None" = None) -> None:
        super().__init__()
        if len(layer_to_group) != config.num_hidden_layers:
            raise ValueError(f"layer_to_group has {len(layer_to_group)} entries for "
                             f"{config.num_hidden_layers} layers")
        self.config = config
        self.backend, self.layer_to_group = backend, layer_to_group
        self.shard = TPShard.of(config, group.rank, group.size) if group is not None else TPShard.of(config)
        self.model = DecoderStack(config, backend, layer_to_group, self.shard, group)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.lm_head = lm_head(self.shard, config.hidden_size, group)
        self.tie_weights()

    @property
    def local_attention_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank's attention layers compute."""
        return self.shard.num_local_heads, self.shard.num_local_kv_heads

    def checkpoint_slice(self, hf_name: str) -> Slice | None:
        """The part of checkpoint tensor `hf_name` this rank holds (None: all of it)."""
        return self.shard.checkpoint_slice(hf_name)

    def unsharded(self) -> "LlamaForCausalLM":
        """This model's single-rank twin on the meta device: every parameter's
        full name and shape (dummy weights are drawn at these shapes, then cut)."""
        with torch.device("meta"):
            return LlamaForCausalLM(self.config, self.backend, self.layer_to_group)

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so; call again
        after `to_empty`, which gives each module its own new parameter."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden].
        `on_layer(i)` runs once layer i's kernels are queued (the runner drains the step
        in flight there: `ModelRunner.run`)."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, positions, self.rotary.inv_freq, meta)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """One [2, num_blocks, block_size, KVH, D] tensor per layer (may alias)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for "
                             f"{len(self.model.layers)} layers")
        for layer, cache in zip(self.model.layers, kv_caches):
            layer.self_attn.kv_cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (casting to each parameter's dtype/device).

        Each tensor is already cut to `checkpoint_slice(name)`: sources read
        only the part this rank holds."""
        targets = self.checkpoint_targets()
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in targets:
                unexpected.append(name)
                continue
            _copy_rows(params, name, tensor, *targets[name])
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match {self.config.architecture}: "
                             f"missing {missing[:20]} ({len(missing)} total), "
                             f"unexpected {unexpected[:20]} ({len(unexpected)} total)")
        self._zero_vocab_padding()

    def _zero_vocab_padding(self) -> None:
        """Rows past the vocabulary (the last rank's padding) give zero logits, never garbage."""
        real = len(self.shard.vocab_rows)
        for module in (self.model.embed_tokens, self.lm_head):
            module.weight.data[real:].zero_()

    def checkpoint_targets(self) -> dict[str, tuple[str, int, int]]:
        """HF name -> (our parameter name, first row, number of rows)."""
        targets = {}
        for param_name, param in self.named_parameters():
            module_path, _, leaf = param_name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj not in ("qkv_proj", "gate_up_proj"):
                part = self.checkpoint_slice(param_name)
                rows = part.length if part is not None and part.dim == 0 else param.shape[0]
                targets[param_name] = (param_name, 0, rows)
                continue
            sizes = self._shard_sizes(proj)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for hf_proj, (fused, shard) in _FUSED_SHARDS.items():
                if fused == proj:
                    targets[f"{parent}.{hf_proj}.{leaf}"] = (param_name, starts[shard], sizes[shard])
        return targets

    def _shard_sizes(self, fused: str) -> list[int]:
        s = self.shard
        if fused == "gate_up_proj":
            return [s.local_intermediate_size, s.local_intermediate_size]
        q, kv = s.num_local_heads * s.head_dim, s.num_local_kv_heads * s.head_dim
        return [q, kv, kv]


def _copy_rows(params: dict[str, nn.Parameter], hf_name: str, tensor: torch.Tensor,
               param_name: str, start: int, rows: int) -> None:
    param = params[param_name]
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {expected}")
    param.data[start:start + rows].copy_(tensor)
