"""Tiny random-weight HF checkpoints of each supported architecture, saved with
`save_pretrained` into a temp dir: the independent reference for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=32)
    if kind == "qwen3-hybrid":
        return transformers.Qwen3Config(
            **COMMON, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=8)
    raise ValueError(kind)


def save_tiny_checkpoint(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    """`overrides` set config fields (e.g. max_position_embeddings)."""
    torch.manual_seed(seed)
    config = tiny_config(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init has tiny weights: scale up so logits are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers generate, one prompt at a time (no padding effects)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
