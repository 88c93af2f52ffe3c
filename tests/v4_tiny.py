"""Tiny random DeepSeek V4 checkpoints (HF transformers `save_pretrained`),
the independent reference for the V4 parity tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# A test module that imports this fixture runs with one torch thread.
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: torch's thread pool costs far more than the math on a busy host."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_v4_config(layer_types: list[str], **overrides) -> "transformers.DeepseekV4Config":
    n = len(layer_types)
    base = dict(
        vocab_size=128, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=n, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=layer_types, mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1),
        compress_rates={CSA: 4, HCA: 8}, hc_mult=2, hc_sinkhorn_iters=3, sliding_window=8, o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=2, max_position_embeddings=256,
        partial_rotary_factor=0.25, bos_token_id=1, eos_token_id=None,  # no eos: greedy runs are full length
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1})
    base.update(overrides)
    return transformers.DeepseekV4Config(**base)


def tiny_v4_model(layer_types: list[str], seed: int = 0, **overrides):
    """A random HF DeepseekV4ForCausalLM with weights large enough to matter
    (non-zero sinks, position biases and router biases; random hash table)."""
    torch.manual_seed(seed)
    config = tiny_v4_config(layer_types, **overrides)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, config.n_routed_experts, buf.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return model


def save_tiny_v4(layer_types: list[str], path: Path, seed: int = 0, **overrides) -> Path:
    tiny_v4_model(layer_types, seed, **overrides).save_pretrained(path)
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int, use_cache: bool = True) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, use_cache=use_cache,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
