"""DeepseekV4ForCausalLM: embeddings -> hc_mult residual streams -> decoder
layers (mHC around attention and MoE) -> hyper head -> norm -> head.

Batches are flat: `query_lens` splits the tokens into sequences, and each
sequence brings its own `SequenceKV` past (state.py). Weight names follow the
DeepSeek checkpoint, which is also what transformers' `save_pretrained`
writes (after normalising its `model.` prefix, `embed_tokens` and `hc_head.`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from kvserve.model.deepseek_v4.attention import V4Attention
from kvserve.model.deepseek_v4.config import DeepseekV4Config
from kvserve.model.deepseek_v4.layers import MoE, RMSNorm, hc_merge, hc_pre, hyper_head
from kvserve.model.deepseek_v4.rope import V4Rope
from kvserve.model.deepseek_v4.state import DenseSequenceKV


class V4Block(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = V4Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config, layer_idx)
        hc = config.hc_mult
        mix = (2 + hc) * hc
        for kind in ("attn", "ffn"):
            self.register_parameter(f"hc_{kind}_fn", nn.Parameter(
                torch.zeros(mix, hc * config.hidden_size, dtype=torch.float32)))
            self.register_parameter(f"hc_{kind}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{kind}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                query_lens: Sequence[int], stores: Sequence, rope: V4Rope, batch=None) -> torch.Tensor:
        fused = batch is not None  # the kernel path: mHC glue and norms as Triton kernels too
        post, comb, x = self._pre("attn", streams, fused)
        if batch is not None:  # paged storage, Triton kernels: the whole batch at once
            attn = self.attn.forward_paged(x, positions, batch, rope)
        else:
            attn = torch.cat([self.attn(xs, ps, store, rope) for xs, ps, store in
                              zip(x.split(list(query_lens)), positions.split(list(query_lens)), stores)])
        streams = self._merge(streams, attn, post, comb, fused)
        post, comb, x = self._pre("ffn", streams, fused)
        return self._merge(streams, self.ffn(x, input_ids), post, comb, fused)

    def _pre(self, kind: str, streams: torch.Tensor, fused: bool):
        """(post, comb, normed block input) of the attention or MoE sub-block."""
        fn, base, scale = (getattr(self, f"hc_{kind}_{p}") for p in ("fn", "base", "scale"))
        norm = self.attn_norm if kind == "attn" else self.ffn_norm
        if fused:
            from kvserve.model.deepseek_v4.kernels.mhc import hc_pre_norm
            return hc_pre_norm(streams, fn, base, scale, norm.weight, norm.eps, self.config)
        post, comb, x = hc_pre(streams, fn, base, scale, self.config)
        return post, comb, norm(x)

    @staticmethod
    def _merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               fused: bool) -> torch.Tensor:
        if fused:
            from kvserve.model.deepseek_v4.kernels import mhc
            return mhc.hc_merge(streams, block_out, post, comb)
        return hc_merge(streams, block_out, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(V4Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        hc = config.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * config.hidden_size, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.rope = V4Rope(config)

    def forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: Sequence[int],
                       stores: Sequence, batch=None) -> torch.Tensor:
        """Final hidden states [T, hidden]; each sequence's tokens are consecutive
        positions continuing its store's past. With `batch` (a `V4PagedBatch`)
        attention runs on the paged storage through the Triton kernels and
        `stores` is unused."""
        if batch is not None:
            # Per-step tensors (window rope) are derived inside every forward: one
            # kept from an earlier run of a static batch (a CUDA graph's warm-up)
            # would be skipped by the capture, and every replay would read it.
            batch.scratch.clear()
        h = self.embed(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, query_lens, stores, self.rope, batch)
        c = self.config
        return self.norm(hyper_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                    c.hc_eps, c.rms_norm_eps))

    def place_rope_tables(self, device: torch.device) -> None:
        """Keep the rope frequency tables on `device` (they are built on the host):
        a forward then copies nothing from pageable host memory, a copy that
        synchronises the stream and cannot be captured in a CUDA graph."""
        self.rope.freqs = {kind: freqs.to(device) for kind, freqs in self.rope.freqs.items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.inference_mode()
    def full_logits(self, input_ids: Sequence[int]) -> torch.Tensor:
        """Uncached forward of one sequence from position 0: logits [S, vocab]."""
        ids = torch.tensor(list(input_ids), device=self.head.weight.device)
        positions = torch.arange(len(ids), device=ids.device)
        return self.compute_logits(self.forward_tokens(ids, positions, [len(ids)], [DenseSequenceKV()]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; every parameter and buffer must be filled."""
        targets = dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers())
        if self.config.tie_word_embeddings:
            targets.pop("head.weight")  # the embedding's
        filled: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                key, expert = checkpoint_key(name)
                if key is None:
                    continue
                if key not in targets:
                    raise ValueError(f"unexpected DeepSeek V4 weight {name!r}")
                target = targets[key] if expert is None else targets[key][expert]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
                filled.add(key if expert is None else f"{key}[{expert}]")
        self._check_filled(targets, filled)

    def _check_filled(self, targets: dict[str, torch.Tensor], filled: set[str]) -> None:
        missing = []
        for key, tensor in targets.items():
            if re.search(r"\.ffn\.w[123]$", key):
                missing += [f"{key}[{e}]" for e in range(tensor.shape[0]) if f"{key}[{e}]" not in filled]
            elif key not in filled:
                missing.append(key)
        if missing:
            raise ValueError(f"DeepSeek V4 checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


_IGNORED = re.compile(r"(^|\.)mtp\.|rotary_emb|\.scale$|_scale_inv$")


def checkpoint_key(name: str) -> tuple[str | None, int | None]:
    """Our parameter name (and expert index for stacked experts) for a checkpoint
    tensor name, in either the DeepSeek or the transformers save_pretrained spelling."""
    if _IGNORED.search(name) and not name.endswith(("hc_attn_scale", "hc_ffn_scale", "hc_head_scale")):
        return None, None
    key = name.removeprefix("model.")
    key = key.replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
    match = re.fullmatch(r"(layers\.\d+\.ffn)\.experts\.(\d+)\.(w[123])\.weight", key)
    if match:
        return f"{match.group(1)}.{match.group(3)}", int(match.group(2))
    return key, None
