"""ModelConfig parsing (rope, sliding semantics vs HF configs, overrides) and
loader errors, without running any model."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention.backend import get_backend
from kvserve.cache.specs import FullAttentionSpec, SlidingWindowSpec
from kvserve.model.config import Llama3RopeScaling, ModelConfig
from kvserve.model.loaders import build_model, resolve_dtype, resolve_model

BASE = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}


def _kinds(specs) -> list[str]:
    return ["full_attention" if s == FullAttentionSpec() else "sliding_attention" for s in specs]


@pytest.mark.parametrize("use_sliding", [True, False])
@pytest.mark.parametrize("max_window_layers", [0, 2, 6])
def test_qwen2_max_window_layers_matches_hf(use_sliding, max_window_layers):
    extra = {"use_sliding_window": use_sliding, "sliding_window": 16,
             "max_window_layers": max_window_layers}
    hf = transformers.Qwen2Config(**{k: v for k, v in BASE.items() if k != "architectures"},
                                  **extra)
    config = ModelConfig.from_hf_config({**BASE, **extra})  # no layer_types: derived
    assert _kinds(config.layer_specs) == hf.layer_types
    if "sliding_attention" in hf.layer_types:
        assert SlidingWindowSpec(window=16) in config.layer_specs


def test_qwen3_layer_types_need_use_sliding_window():
    """Qwen3Config nulls sliding_window unless use_sliding_window: all layers full."""
    cfg = {**BASE, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention"] * 3}
    assert set(ModelConfig.from_hf_config(cfg).layer_specs) == {FullAttentionSpec()}
    config = ModelConfig.from_hf_config(cfg, {"use_sliding_window": True,
                                              "attention_sink_size": 4})
    assert config.layer_specs[0] == SlidingWindowSpec(window=8, sink=4)
    assert config.layer_specs[1] == FullAttentionSpec()
    assert config.head_dim == 128 and config.qk_norm  # Qwen3Config's default head_dim


def test_rope_parameters_and_legacy_rope_scaling_agree():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama = {**BASE, "architectures": ["LlamaForCausalLM"]}
    new = ModelConfig.from_hf_config({**llama, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    old = ModelConfig.from_hf_config({**llama, "rope_theta": 5e5, "rope_scaling": scaling})
    assert new == old
    assert new.rope_theta == 5e5
    assert new.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)


def test_hf_overrides_and_generation_eos():
    config = ModelConfig.from_hf_config({**BASE, "eos_token_id": 5}, {"num_hidden_layers": 2},
                                        generation_config={"eos_token_id": [5, 7]})
    assert config.num_hidden_layers == 2 and len(config.layer_specs) == 2
    assert config.eos_token_ids == (5, 7)
    assert config.qkv_bias and not config.o_proj_bias  # Qwen2 biases q/k/v only


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_invalid_heads_named():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config({**BASE, "num_key_value_heads": 3})


def test_missing_paths_are_named(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model(missing + ".gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="dummy:nope.*dummy:qwen3-8b"):
        resolve_model("dummy:nope")
    with pytest.raises(ValueError, match="load_format 'pt'"):
        resolve_model(str(tmp_path), load_format="pt")


def test_dummy_models_build_and_run():
    assert resolve_model("dummy:qwen3-8b").config.num_hidden_layers == 36
    assert resolve_model("dummy:llama3-8b").config.rope_scaling is not None
    resolved = resolve_model("dummy:tiny-qwen3")
    config = resolved.config
    model = build_model(config, get_backend("torch"), [0] * config.num_hidden_layers)
    resolved.weights.load_into(model)
    assert resolved.tokenizer is None
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones(config.hidden_size))
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16


def test_checkpoint_mismatch_names_weights():
    resolved = resolve_model("dummy:tiny-llama")
    config = resolved.config
    model = build_model(config, get_backend("torch"), [0] * config.num_hidden_layers)
    weights = [("model.norm.weight", torch.ones(64)), ("model.bogus.weight", torch.ones(1))]
    with pytest.raises(ValueError, match="model.embed_tokens.weight.*model.bogus.weight"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(3))])
