"""Dummy (random, seeded) weights of named real or tiny shapes, like vLLM's
`load_format="dummy"`: benchmarks on real shapes without a checkpoint.

The shape is a `dummy:<name>` from `DUMMY_CONFIGS`, or an HF directory's
config.json (weights, if any, are ignored; its tokenizer is loaded), so two
engines can serve the same random model with the same tokenizer.

What the weights are drawn from depends on the source of the shape:
- an HF directory: every parameter Uniform(-1e-3, 1e-3), as vLLM's dummy
  loader draws them (norm weights included). This is the path for comparing
  engines on one directory, and the values must match in distribution: a
  compute-bound GEMM draws more power on larger, denser values, and at the
  power cap its clock drops. On one H100 kvserve's qa scenario ran 1.4%
  faster on vLLM's distribution than on the normal one below
  (docs/BENCHMARKS.md, 2026-12-05).
- a `dummy:<name>` shape: Normal(0, 0.02) matrices, zero biases, unit norm
  weights. Activations then keep a useful scale through the layers, so tests and
  benchmarks that look at the outputs see varied tokens.

Weights are drawn directly on the model's device, so an 8B model never
passes through host memory. Each parameter is drawn at its single-rank shape;
a tensor-parallel rank keeps its part of it, so every tensor-parallel size
serves the same model.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from kvserve.distributed.sharding import narrow
from kvserve.model.config import ModelConfig
from kvserve.model.loaders.base import ResolvedModel, register_loader
from kvserve.model.loaders.hf_files import read_json, tokenizer_in

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM

PREFIX = "dummy:"
VLLM_BOUND = 1e-3   # vLLM's `initialize_dummy_weights` draws every parameter from Uniform(-1e-3, 1e-3)
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-8B config.json shapes.
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    # meta-llama/Llama-3.1-8B-Instruct shapes (same as Llama-3-8B plus llama3 RoPE).
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 1},
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 512,
        "use_sliding_window": True, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "tie_word_embeddings": False, "eos_token_id": 1},
}
# meta-llama/Llama-3.1-70B-Instruct shapes (tensor-parallel benchmarks): Llama-3.1-8B's
# config with the 70B sizes.
DUMMY_CONFIGS["llama3-70b"] = {**DUMMY_CONFIGS["llama3-8b"], "hidden_size": 8192, "intermediate_size": 28672,
                               "num_hidden_layers": 80, "num_attention_heads": 64}


@dataclass(frozen=True)
class DummyWeights:
    seed: int = 0
    std: float = 0.02
    like_vllm: bool = False   # every parameter Uniform(-VLLM_BOUND, VLLM_BOUND) (module doc)

    @torch.no_grad()
    def load_into(self, model: "LlamaForCausalLM") -> None:
        """The weights the module doc describes, each parameter from its own seed."""
        if model.shard.size == 1:
            for name, param in model.named_parameters():
                self._fill(name, param)
            return
        model.load_weights(self._checkpoint_parts(model))

    def _fill(self, name: str, tensor: torch.Tensor) -> None:
        generator = torch.Generator(device=tensor.device).manual_seed(self.seed + _stable_hash(name))
        if self.like_vllm:
            tensor.uniform_(-VLLM_BOUND, VLLM_BOUND, generator=generator)
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, self.std, generator=generator)

    def _checkpoint_parts(self, model: "LlamaForCausalLM") -> Iterator[tuple[str, torch.Tensor]]:
        """Each single-rank parameter drawn whole (one at a time), split into its
        checkpoint tensors, each cut to this rank's part."""
        like = next(model.parameters())
        full = model.unsharded()
        pieces = defaultdict(list)
        for hf_name, (param_name, start, rows) in full.checkpoint_targets().items():
            pieces[param_name].append((hf_name, start, rows))
        for name, param in full.named_parameters():
            tensor = torch.empty(param.shape, dtype=like.dtype, device=like.device)
            self._fill(name, tensor)
            for hf_name, start, rows in pieces[name]:
                yield hf_name, narrow(tensor[start:start + rows], model.checkpoint_slice(hf_name))


def _stable_hash(name: str) -> int:
    """Per-parameter seed offset independent of PYTHONHASHSEED."""
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2 ** 31)


@register_loader("dummy")
def resolve_dummy(model: str, hf_overrides: dict[str, Any] | None, with_tokenizer: bool = True) -> ResolvedModel:
    if not model.startswith(PREFIX) and Path(model).is_dir():
        return _resolve_hf_directory(model, hf_overrides, with_tokenizer)
    shape = model.removeprefix(PREFIX)
    if shape not in DUMMY_CONFIGS:
        raise ValueError(f"unknown dummy model {model!r}; pass an HF directory with a "
                         f"config.json or one of: "
                         f"{', '.join(PREFIX + name for name in DUMMY_CONFIGS)}")
    config = ModelConfig.from_hf_config(DUMMY_CONFIGS[shape], hf_overrides)
    return ResolvedModel(name=model, load_format="dummy", config=config,
                         weights=DummyWeights(), tokenizer=None)


def _resolve_hf_directory(model: str, hf_overrides: dict[str, Any] | None, with_tokenizer: bool) -> ResolvedModel:
    """The directory's config (and generation config, for eos ids) and tokenizer."""
    directory = Path(model)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"load_format=dummy with directory {model!r} needs its "
                                f"config.json, which is missing")
    config = ModelConfig.from_hf_config(
        read_json(config_path), hf_overrides,
        generation_config=read_json(directory / "generation_config.json"))
    return ResolvedModel(name=model, load_format="dummy", config=config,
                         weights=DummyWeights(like_vllm=True),
                         tokenizer=tokenizer_in(directory) if with_tokenizer else None)
