"""Tensor-parallel sharding without processes: the head / row / vocabulary
split against brute force over many shapes, each loader's rank shards
against slices of the single-rank model (taken with an independent GQA
mapping: query head h reads KV head h // (H / KVH), as HF's repeat_kv), and
the start-up errors, each naming its values."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import get_backend
from kvserve.config import EngineArgs
from kvserve.distributed.launcher import check_devices
from kvserve.distributed.sharding import TPShard, validate_tp
from kvserve.entrypoints.llm import LLM
from kvserve.model.config import ModelConfig
from kvserve.model.loaders import build_model, embedded_gguf_path, resolve_model
from kvserve.model.loaders.gguf_loader import GGUFWeights, hf_config_from_gguf
from tests.tiny_models import save_tiny_checkpoint


def _config(heads: int, kv_heads: int, intermediate: int = 64, vocab: int = 50) -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 8 * heads,
        "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 8})


def _shapes():
    for heads in (1, 2, 4, 8, 12, 32, 64):
        for kv_heads in (k for k in range(1, heads + 1) if heads % k == 0):
            for size in (1, 2, 3, 4, 8):
                yield heads, kv_heads, size


@pytest.mark.parametrize("heads,kv_heads,size", list(_shapes()))
def test_heads_split_or_refused(heads, kv_heads, size):
    config = _config(heads, kv_heads, intermediate=24)
    if heads % size or 24 % size or (kv_heads % size and size % kv_heads):
        with pytest.raises(ValueError, match=f"tensor_parallel_size \\({size}\\)"):
            validate_tp(config, size)
        return
    shards = [TPShard.of(config, r, size) for r in range(size)]
    assert sorted(h for s in shards for h in s.q_heads) == list(range(heads))
    group = heads // kv_heads
    holders = {k: 0 for k in range(kv_heads)}
    for s in shards:
        assert set(s.kv_heads) == {h // group for h in s.q_heads}  # exactly the KV heads its queries read
        assert len(s.kv_heads) == s.num_local_kv_heads and s.num_local_heads * size == heads
        for k in s.kv_heads:
            holders[k] += 1
    assert set(holders.values()) == {shards[0].kv_replicas}


@pytest.mark.parametrize("vocab,size", [(50, 1), (50, 2), (50, 3), (5, 4), (128256, 8)])
def test_vocabulary_rows_cover_it_once_with_padding_last(vocab, size):
    shards = [TPShard.of(_config(24, 24, intermediate=48, vocab=vocab), r, size) for r in range(size)]
    rows = [i for s in shards for i in s.vocab_rows]
    assert rows == list(range(vocab))
    per_rank = shards[0].vocab_rows_per_rank
    assert per_rank * size >= vocab > (per_rank - 1) * size
    assert all(s.vocab_rows.start == min(r * per_rank, vocab) for r, s in enumerate(shards))


def test_checkpoint_slices_name_the_rank_part():
    shard = TPShard.of(_config(8, 2, intermediate=64, vocab=50), rank=1, size=4)  # KV heads replicated
    layer = "model.layers.3."
    expect = {"self_attn.q_proj.weight": (0, 16, 32), "self_attn.q_proj.bias": (0, 16, 32),
              "self_attn.k_proj.weight": (0, 0, 8), "self_attn.v_proj.bias": (0, 0, 8),
              "self_attn.o_proj.weight": (1, 16, 32), "mlp.gate_proj.weight": (0, 16, 32),
              "mlp.up_proj.weight": (0, 16, 32), "mlp.down_proj.weight": (1, 16, 32)}
    for name, (dim, start, stop) in expect.items():
        part = shard.checkpoint_slice(layer + name)
        assert (part.dim, part.start, part.stop) == (dim, start, stop), name
    for replicated in ("self_attn.o_proj.bias", "input_layernorm.weight", "self_attn.q_norm.weight"):
        assert shard.checkpoint_slice(layer + replicated) is None
    assert shard.checkpoint_slice("model.embed_tokens.weight").start == 13
    assert shard.checkpoint_slice("lm_head.weight").stop == 26
    assert TPShard.of(_config(8, 2)).checkpoint_slice(layer + "self_attn.q_proj.weight") is None


# -- loaders: each rank's shard is its slice of the single-rank model ---------------------------
class _LoadOnly:
    """A group to build and load one rank's shard in this process (no forward)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _expected_shard(full: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
                    ) -> dict[str, torch.Tensor]:
    d, heads, kv_heads, inter = (config.head_dim, config.num_attention_heads, config.num_key_value_heads,
                                 config.intermediate_size)
    q_heads = range(rank * heads // size, (rank + 1) * heads // size)
    kv = sorted({h // (heads // kv_heads) for h in q_heads})
    q_rows = [h * d + i for h in q_heads for i in range(d)]
    kv_rows = [k * d + i for k in kv for i in range(d)]
    qkv_rows = q_rows + [heads * d + r for r in kv_rows] + [(heads + kv_heads) * d + r for r in kv_rows]
    mlp = list(range(rank * inter // size, (rank + 1) * inter // size))
    per_rank = -(-config.vocab_size // size)
    vocab = list(range(rank * per_rank, min((rank + 1) * per_rank, config.vocab_size)))
    out = {}
    for name, t in full.items():
        if "qkv_proj" in name:
            out[name] = t[qkv_rows]
        elif "gate_up_proj" in name:
            out[name] = t[mlp + [inter + r for r in mlp]]
        elif "o_proj.weight" in name:
            out[name] = t[:, q_rows]
        elif "down_proj" in name:
            out[name] = t[:, mlp]
        elif "embed_tokens" in name or "lm_head" in name:
            out[name] = torch.cat([t[vocab], t.new_zeros(per_rank - len(vocab), t.shape[1])])
        else:
            out[name] = t
    return out


def _params(resolved, group=None) -> dict[str, torch.Tensor]:
    config = resolved.config
    model = build_model(config, get_backend("torch"), [0] * config.num_hidden_layers, "float32", "cpu", group)
    resolved.weights.load_into(model)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _assert_shards_match(resolved, size: int) -> None:
    full = _params(resolved)
    for rank in range(size):
        got = _params(resolved, _LoadOnly(rank, size))
        expected = _expected_shard(full, resolved.config, rank, size)
        assert got.keys() == expected.keys()
        for name in got:
            assert torch.equal(got[name], expected[name]), (rank, name)


@pytest.mark.parametrize("kind,kv_heads,size", [("qwen2", 2, 2), ("qwen3", 1, 2), ("llama", 2, 4)])
def test_safetensors_shards(tmp_path, kind, kv_heads, size):
    path = save_tiny_checkpoint(kind, tmp_path / kind, num_key_value_heads=kv_heads,
                                vocab_size=255, tie_word_embeddings=kind == "llama")
    _assert_shards_match(resolve_model(str(path)), size)


@pytest.mark.parametrize("size", [2, 4])
def test_dummy_shards_are_slices_of_the_single_rank_draw(size):
    _assert_shards_match(resolve_model("dummy:tiny-qwen3"), size)


def _independent_part(name: str, full: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q_heads = range(rank * heads // size, (rank + 1) * heads // size)
    q_rows = [h * d + i for h in q_heads for i in range(d)]
    kv_rows = [k * d + i for k in sorted({h // (heads // kv_heads) for h in q_heads}) for i in range(d)]
    mlp = list(range(rank * config.intermediate_size // size, (rank + 1) * config.intermediate_size // size))
    per_rank = -(-config.vocab_size // size)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": mlp, "up_proj": mlp,
            "embed_tokens": range(rank * per_rank, min((rank + 1) * per_rank, config.vocab_size))}
    columns = {"o_proj": q_rows, "down_proj": mlp}
    proj = name.split(".")[-2]
    if proj in rows:
        return full[list(rows[proj])]
    return full[:, columns[proj]] if proj in columns else full


def test_gguf_parts_dequantize_only_their_rows():
    """SmolLM2-135M over 3 ranks (9 query heads, 3 KV heads, llama.cpp-permuted
    q/k rows): each rank's tensors of the embedding and layer 0 (the rest
    repeat the pattern) are the independent slices of the whole tensors."""
    from gguf import GGUFReader
    reader = GGUFReader(str(embedded_gguf_path()))  # not resolve_model: its tokenizer takes ~30 s
    config = ModelConfig.from_hf_config(hf_config_from_gguf(reader))
    weights = GGUFWeights(reader, config.num_attention_heads, config.num_key_value_heads)
    for rank in range(3):
        shard = TPShard.of(config, rank, 3)
        checked = 0
        for (name, part), (same, whole) in zip(weights.iter_weights(shard.checkpoint_slice), weights.iter_weights()):
            if name.startswith("model.layers.1."):
                break
            assert name == same and torch.equal(part, _independent_part(name, whole, config, rank, 3)), name
            checked += 1
        assert checked >= 10


# -- start-up errors -------------------------------------------------------------------
def test_heads_not_divisible_is_refused_before_any_worker_starts(tmp_path):
    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"):
        LLM(str(path), device="cpu", tensor_parallel_size=3)


@pytest.mark.parametrize("overrides,message", [
    ({"intermediate_size": 129}, r"intermediate_size \(129\) must be divisible by tensor_parallel_size \(2\)"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16},
     r"num_key_value_heads \(3\) must be divisible by tensor_parallel_size \(2\) or divide it"),
])
def test_model_shapes_that_do_not_split_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        LLM("dummy:tiny-llama", device="cpu", hf_overrides=overrides, tensor_parallel_size=2)


def test_deepseek_v4_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match=r"DeepSeek V4 is not supported with tensor parallelism yet "
                                         r"\(tensor_parallel_size=2\)"):
        LLM("dummy:tiny-deepseek-v4", device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"tensor_parallel_size": 2, "cpu_kv_cache_gb": 1.0}, r"cpu_kv_cache_gb=1.0\) is not supported"),
])
def test_engine_args_refuse_bad_tensor_parallel_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_more_ranks_than_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs but 1 are visible"):
        check_devices(2, torch.device("cuda"))


def test_mixed_gpu_models_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: ["NVIDIA H200", "NVIDIA H100"][i])
    with pytest.raises(ValueError, match=r"same GPU model on every rank; got \['NVIDIA H200', 'NVIDIA H100'\]"):
        check_devices(2, torch.device("cuda"))


def test_an_indexed_device_is_refused():
    with pytest.raises(ValueError, match="ranks use cuda:0..cuda:1; got device='cuda:1'"):
        check_devices(2, torch.device("cuda", 1))
