"""Loading DeepSeek V4: an HF checkpoint directory (config.json + safetensors,
fp32 or bf16) or dummy shapes (`dummy:deepseek-v4-flash`, `dummy:deepseek-v4-flash-l8`,
`dummy:tiny-deepseek-v4`) with seeded random weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from kvserve.model.deepseek_v4.config import DeepseekV4Config
from kvserve.model.deepseek_v4.model import DeepseekV4ForCausalLM

DUMMY_PREFIX = "dummy:"
_FLASH = {  # deepseek-ai/DeepSeek-V4-Flash config.json dims (checkpoint form)
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    # transformers' default schedule (2 HCA, then CSA/HCA interleaved); one extra entry for the MTP layer.
    "compress_ratios": [128, 128] + [4 if i % 2 else 128 for i in range(41)] + [0],
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1}
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": _FLASH,
    # Real per-layer dims, 8 layers (2 sliding, then CSA/HCA alternating), 32 experts:
    # 8.6B parameters, about 17 GB of bf16 weights, leaving most of an H200 to the KV cache.
    "deepseek-v4-flash-l8": {**_FLASH, "num_hidden_layers": 8, "n_routed_experts": 32,
                             "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128]},
    "tiny-deepseek-v4": {**_FLASH, "vocab_size": 128, "hidden_size": 32, "moe_intermediate_size": 32,
                         "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 32,
                         "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
                         "num_experts_per_tok": 2, "n_routed_experts": 4, "num_hash_layers": 1, "hc_mult": 2,
                         "hc_sinkhorn_iters": 3, "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 16,
                         "index_topk": 2, "compress_ratios": [4, 128, 0], "max_position_embeddings": 4096},
}


def load_deepseek_v4(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                     hf_overrides: dict[str, Any] | None = None, seed: int = 0) -> DeepseekV4ForCausalLM:
    if model.startswith(DUMMY_PREFIX):
        config = dummy_config(model.removeprefix(DUMMY_PREFIX), hf_overrides)
        module = _build(config, dtype, device)
        _fill_dummy(module, seed)
        return module
    directory = Path(model)
    config = DeepseekV4Config.from_hf_config(json.loads((directory / "config.json").read_text()), hf_overrides)
    module = _build(config, dtype, device)
    module.load_weights(_iter_safetensors(sorted(directory.glob("*.safetensors"))))
    _check_expert_ids(module)
    return module


def _check_expert_ids(module: DeepseekV4ForCausalLM) -> None:
    """Hash routers' expert ids index the expert weights on the device, where
    nothing bounds-checks them: an id out of range is refused at load time."""
    num_experts = module.config.n_routed_experts
    for name, ids in module.named_buffers():
        if name.endswith("tid2eid") and ids.numel():
            bad = ids[(ids < 0) | (ids >= num_experts)]
            if bad.numel():
                raise ValueError(f"{name}: expert id {int(bad[0])} is outside [0, {num_experts}) "
                                 f"(n_routed_experts)")


def dummy_config(shape: str, hf_overrides: dict[str, Any] | None = None) -> DeepseekV4Config:
    if shape not in DUMMY_CONFIGS:
        raise ValueError(f"unknown DeepSeek V4 dummy shape {shape!r}; available: {sorted(DUMMY_CONFIGS)}")
    return DeepseekV4Config.from_hf_config(DUMMY_CONFIGS[shape], hf_overrides)


def _build(config: DeepseekV4Config, dtype: torch.dtype, device: str) -> DeepseekV4ForCausalLM:
    """Built on the meta device in `dtype`; norms, sinks, position biases and mHC
    weights are declared float32 and stay so (as transformers keeps them)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = DeepseekV4ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    module = module.to_empty(device=device)
    if config.tie_word_embeddings:
        module.head.weight = module.embed.weight
    return module.eval()


def _fill_dummy(module: DeepseekV4ForCausalLM, seed: int) -> None:
    device = module.head.weight.device
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm.weight", "_scale")):
                p.fill_(1.0)
            elif p.dim() <= 1 or name.endswith("ape"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
        for name, buf in module.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, module.config.n_routed_experts, buf.shape, generator=g, device=device))
            else:
                buf.zero_()


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    if not files:
        raise FileNotFoundError("the DeepSeek V4 checkpoint has no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise ValueError(f"{name!r} is FP8: block-quantized V4 checkpoints are not supported yet; "
                                     "convert to bf16 first")
                yield name, tensor
