"""Logit parity of our LlamaForCausalLM (torch reference backend, paged KV)
against HF transformers for each architecture, over a prefill and decodes."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention.backend import get_backend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.model.loaders import build_model, resolve_model

BLOCK_SIZE = 4
PROMPT_LEN = 20
DECODE_STEPS = 4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)


def _hf_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "llama3-rope-tied":
        return transformers.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})
    if kind == "mistral-sliding":
        return transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=8)
    if kind == "qwen2-sliding":
        return transformers.Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=1)
    if kind == "qwen3-hybrid":
        return transformers.Qwen3Config(
            **COMMON, num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2)
    raise ValueError(kind)


EXPECTED_SPECS = {
    "llama3-rope-tied": [FullAttentionSpec()] * 2,
    "mistral-sliding": [SlidingWindowSpec(8)] * 2,
    "qwen2-sliding": [FullAttentionSpec(), SlidingWindowSpec(8), SlidingWindowSpec(8)],
    "qwen3-hybrid": [SlidingWindowSpec(8), FullAttentionSpec()] * 2,
}


def _save_checkpoint(kind: str, path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), dtype=torch.float32)
    with torch.no_grad():  # default init is tiny; larger weights separate the logits
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() > 1 else 0.3)
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(path)
    return model.eval()


def single_sequence_metadata(num_computed: int, num_new: int, num_groups: int,
                             max_blocks: int = 16) -> AttentionMetadata:
    """One sequence whose blocks are 1, 2, 3, ... (block 0 is the NULL block)."""
    seq_len = num_computed + num_new
    table = torch.arange(1, max_blocks + 1, dtype=torch.int32)[None]
    positions = torch.arange(num_computed, seq_len)
    slots = (positions // BLOCK_SIZE + 1) * BLOCK_SIZE + positions % BLOCK_SIZE
    return AttentionMetadata(
        num_seqs=1, num_tokens=num_new, block_size=BLOCK_SIZE,
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=[table] * num_groups, slot_mappings=[slots] * num_groups,
        max_query_len=num_new, max_seq_len=seq_len,
        query_lens_cpu=[num_new], seq_lens_cpu=[seq_len])


def _layer_to_group(specs) -> list[int]:
    groups: dict = {}
    return [groups.setdefault(spec, len(groups)) for spec in specs]


@pytest.mark.parametrize("kind", list(EXPECTED_SPECS))
def test_logits_match_hf(kind, tmp_path):
    hf_model = _save_checkpoint(kind, tmp_path)
    resolved = resolve_model(str(tmp_path))
    config = resolved.config
    assert list(config.layer_specs) == EXPECTED_SPECS[kind]
    layer_to_group = _layer_to_group(config.layer_specs)
    model = build_model(config, get_backend("torch"), layer_to_group, dtype="float32")
    resolved.weights.load_into(model)
    kv_shape = (2, 17, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    model.bind_kv_caches([torch.zeros(kv_shape) for _ in range(config.num_hidden_layers)])

    tokens = torch.randint(3, 256, (PROMPT_LEN + DECODE_STEPS,),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0]
        num_groups = max(layer_to_group) + 1
        meta = single_sequence_metadata(0, PROMPT_LEN, num_groups)
        hidden = model(tokens[:PROMPT_LEN], torch.arange(PROMPT_LEN), meta)
        got = [model.compute_logits(hidden)]
        for pos in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
            meta = single_sequence_metadata(pos, 1, num_groups)
            hidden = model(tokens[pos:pos + 1], torch.tensor([pos]), meta)
            got.append(model.compute_logits(hidden))
    got_logits = torch.cat(got)
    assert got_logits.dtype == torch.float32
    torch.testing.assert_close(got_logits, expected, atol=1e-4, rtol=1e-4)
