"""The embedded SmolLM2 GGUF: config from metadata, dequantized weights equal
to transformers' own GGUF loading, and a greedy answer containing "Paris"."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.attention.backend import get_backend
from kvserve.model.loaders import build_model, embedded_gguf_path, resolve_model
from kvserve.model.loaders.gguf_loader import unpermute_rope_rows
from tests.test_model_parity import single_sequence_metadata

BLOCK_SIZE = 4  # single_sequence_metadata's block size
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def resolved():
    return resolve_model(None)


@pytest.fixture(scope="module")
def model(resolved):
    config = resolved.config
    module = build_model(config, get_backend("torch"), [0] * config.num_hidden_layers,
                         dtype="float32")
    resolved.weights.load_into(module)
    return module


def test_config_from_metadata(resolved):
    c = resolved.config
    assert resolved.load_format == "gguf"
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.rope_theta == 100000.0
    assert c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.eos_token_ids == (2,)
    assert resolved.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert resolved.tokenizer.chat_template


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 8, 5)
    # llama.cpp convert_hf_to_gguf.py `permute`: per head, (2, half) -> (half, 2).
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    torch.testing.assert_close(unpermute_rope_rows(permuted, 3), w)


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own GGUF reading (config, dequantization, un-permutation)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = embedded_gguf_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    return hf.eval(), tensors


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(model, hf_reference):
    _, hf_state = hf_reference
    ours = dict(model.named_parameters())
    h, kv, inter = 9 * 64, 3 * 64, 1536
    for i in range(30):
        layer = f"model.layers.{i}."
        qkv = ours[layer + "self_attn.qkv_proj.weight"]
        gate_up = ours[layer + "mlp.gate_up_proj.weight"]
        pairs = [(qkv[:h], "self_attn.q_proj"), (qkv[h:h + kv], "self_attn.k_proj"),
                 (qkv[h + kv:], "self_attn.v_proj"), (gate_up[:inter], "mlp.gate_proj"),
                 (gate_up[inter:], "mlp.up_proj")]
        pairs += [(ours[layer + n + ".weight"], n) for n in (
            "self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
        for ours_weight, name in pairs:
            torch.testing.assert_close(ours_weight, hf_state[layer + name + ".weight"],
                                       atol=0, rtol=0)
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        torch.testing.assert_close(ours[name], hf_state[name], atol=0, rtol=0)


@pytest.mark.slow
def test_logits_match_transformers(resolved, model, hf_reference):
    hf, _ = hf_reference
    c = resolved.config
    tokens = torch.tensor(resolved.tokenizer("The capital of France is").input_ids)
    model.bind_kv_caches([torch.zeros(2, 8, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
                          for _ in range(c.num_hidden_layers)])
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
        meta = single_sequence_metadata(0, len(tokens), 1, max_blocks=7)
        got = model.compute_logits(model(tokens, torch.arange(len(tokens)), meta))
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_greedy_answer_mentions_paris(resolved, model):
    tokenizer = resolved.tokenizer
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(ids, add_special_tokens=False).input_ids
    c = resolved.config
    num_blocks = 1 + (len(prompt) + 16) // BLOCK_SIZE + 1
    model.bind_kv_caches([
        torch.zeros(2, num_blocks, BLOCK_SIZE, c.num_key_value_heads, c.head_dim)
        for _ in range(c.num_hidden_layers)])
    generated = _greedy(model, prompt, 12, num_blocks - 1, c.eos_token_ids)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in text, text


def _greedy(model, prompt: list[int], max_new: int, max_blocks: int,
            eos_ids: tuple[int, ...]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        meta = single_sequence_metadata(0, len(tokens), 1, max_blocks)
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), meta)
        for _ in range(max_new):
            next_token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            if next_token in eos_ids:
                break
            tokens.append(next_token)
            pos = len(tokens) - 1
            meta = single_sequence_metadata(pos, 1, 1, max_blocks)
            hidden = model(torch.tensor([next_token]), torch.tensor([pos]), meta)
    return tokens[len(prompt):]
