"""The HF transformers baseline: the same prompts through `generate` as one
static padded batch, in the same process, so both engines see the same machine."""
from __future__ import annotations

import time
import torch

from kvserve.bench.throughput import ThroughputResult, _sync


def load_hf_model(model: str | None, device: torch.device, dtype: torch.dtype, load_format: str = "auto"):
    import transformers
    from kvserve.model.loaders import detect_format, embedded_gguf_path
    from kvserve.model.loaders.dummy import DUMMY_CONFIGS, PREFIX
    name = str(embedded_gguf_path()) if model is None else model
    fmt = detect_format(name) if load_format == "auto" else load_format
    if fmt == "dummy":
        cfg = dict(DUMMY_CONFIGS[name.removeprefix(PREFIX)])
        arch = cfg.pop("architectures")[0]
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif fmt == "gguf":
        hf = _hf_from_gguf(name, dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return hf.to(device).eval()


def _hf_from_gguf(path: str, dtype: torch.dtype):
    """HF's own GGUF path needs `accelerate`; build the HF Llama from the GGUF
    config and the dequantized tensors instead (the timing is what matters)."""
    import transformers
    from gguf import GGUFReader
    from kvserve.model.loaders.gguf_loader import GGUFWeights, hf_config_from_gguf
    reader = GGUFReader(path)
    cfg = hf_config_from_gguf(reader)
    cfg.pop("architectures", None)
    config = transformers.LlamaConfig(**cfg)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = GGUFWeights(reader, config.num_attention_heads, config.num_key_value_heads)
    state = dict(weights.iter_weights())
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):
        raise RuntimeError(f"GGUF -> HF weights mismatch: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


@torch.inference_mode()
def run_hf_generate(model: str | None, prompts: list[list[int]], output_len: int, device: torch.device,
                    dtype: torch.dtype, load_format: str = "auto", repeats: int = 1) -> ThroughputResult:
    hf = load_hf_model(model, device, dtype, load_format)
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, **kwargs)
    elapsed = float("inf")
    for _ in range(repeats):  # best of `repeats`, as for kvserve
        _sync()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        _sync()
        elapsed = min(elapsed, time.perf_counter() - start)
    if out.shape[1] - ids.shape[1] != output_len:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, expected {output_len}")
    return ThroughputResult("hf-transformers", elapsed, len(prompts), ids.shape[1], output_len)
