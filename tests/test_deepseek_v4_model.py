"""DeepSeek V4 model: config parsing (HF and checkpoint forms, clear errors),
safetensors loading of transformers' save_pretrained output, and parity with
transformers' uncached forward and cached generate (fp32, tiny random configs)."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.model.deepseek_v4.config import DeepseekV4Config
from kvserve.model.deepseek_v4.generate import greedy_generate
from kvserve.model.deepseek_v4.loader import dummy_config, load_deepseek_v4
from tests.v4_tiny import CSA, HCA, SLIDING, one_thread, hf_greedy, tiny_v4_model  # noqa: F401 (one_thread: autouse)

HF_FORM = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "head_dim": 32, "num_attention_heads": 4,
           "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "index_head_dim": 16, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "partial_rotary_factor": 0.25, "layer_types": [CSA, HCA, SLIDING],
           "mlp_layer_types": ["hash_moe", "moe", "moe"],
           "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                            "original_max_position_embeddings": 64, "attention_factor": 1.0}}}
CHECKPOINT_FORM = {k: v for k, v in HF_FORM.items()
                   if k not in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")} | {
    "compress_ratios": [4, 128, 0, 0], "num_hash_layers": 1, "qk_rope_head_dim": 8, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}}


def test_both_config_forms_agree():
    assert DeepseekV4Config.from_hf_config(HF_FORM) == DeepseekV4Config.from_hf_config(CHECKPOINT_FORM)


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [4, 128]}, "compress_ratios has 2 entries for num_hidden_layers=3"),
    ({"compress_ratios": [4, 64, 0]}, "compress_ratios entries must be 0, 4 or 128"),
    ({"index_topk": 0}, "index_topk must be >= 1, got 0"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds n_routed_experts (4)"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
])
def test_inconsistent_config_is_rejected(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeepseekV4Config.from_hf_config(CHECKPOINT_FORM | change)


def test_hf_layer_types_must_cover_every_layer():
    with pytest.raises(ValueError, match="layer_types has 2 entries for num_hidden_layers=3"):
        DeepseekV4Config.from_hf_config(HF_FORM | {"layer_types": [CSA, HCA]})


def test_dummy_shapes():
    flash = dummy_config("deepseek-v4-flash")
    assert (flash.num_hidden_layers, flash.head_dim, flash.sliding_window, flash.index_topk) == (43, 512, 128, 512)
    assert flash.compress_yarn is not None and flash.qk_rope_head_dim == 64
    assert dummy_config("deepseek-v4-flash-l8").num_hidden_layers == 8
    tiny = load_deepseek_v4("dummy:tiny-deepseek-v4")
    assert torch.isfinite(tiny.full_logits(list(range(3, 20)))).all()


def _pair(tmp_path, types, **overrides):
    hf = tiny_v4_model(types, **overrides)
    hf.save_pretrained(tmp_path)
    return hf, load_deepseek_v4(str(tmp_path))


# CSA with 16 indexer heads: index scores never tie, so transformers' top-k is unambiguous.
PARITY_CASES = [([SLIDING] * 2, {}), ([HCA] * 2, {}), ([CSA, HCA, SLIDING], {"index_n_heads": 16}),
                ([CSA] * 2, {"index_topk": 64}),
                # hidden size != head_dim: the real shapes (4096 vs 512); equal widths hid a bug once
                ([SLIDING, CSA, HCA], {"hidden_size": 48, "index_n_heads": 16})]


@pytest.mark.parametrize("types, overrides", PARITY_CASES)
def test_uncached_forward_matches_transformers(tmp_path, types, overrides):
    hf, ours = _pair(tmp_path, types, **overrides)
    ids = torch.randint(3, 128, (37,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(ours.full_logits(ids.tolist()), expected, atol=2e-5, rtol=1e-4)


def test_checkpoint_must_be_complete(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_v4_model([HCA]).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.attn.compressor.ape"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensor"):
        load_deepseek_v4(str(tmp_path))


def test_hash_router_expert_ids_out_of_range_are_refused(tmp_path):
    """The grouped-GEMM path reads expert ids with no bounds check on the device."""
    from safetensors.torch import load_file, save_file
    tiny_v4_model([HCA, HCA]).save_pretrained(tmp_path)  # layer 0 routes by hash
    tensors = load_file(tmp_path / "model.safetensors")
    (name,) = [n for n in tensors if n.endswith("tid2eid")]
    tensors[name][5, 1] = 4  # the tiny config has 4 experts
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"expert id 4 is outside \[0, 4\)"):
        load_deepseek_v4(str(tmp_path))


def test_greedy_matches_transformers_generate(tmp_path):
    """Prompts of 1..70 tokens in one batch, chunks of 5 and 13 tokens that split
    compression windows anywhere, 24 new tokens: identical to HF generate."""
    hf, ours = _pair(tmp_path, [HCA, SLIDING])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (1, 6, 23, 70)]
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    for chunk in (5, 13):
        assert greedy_generate(ours, prompts, 24, chunk) == expected
