"""GGUF files (llama.cpp): config from metadata, weights dequantized at load.

Owns the llama.cpp -> HF name mapping and undoing llama.cpp's q/k row
permutation (its converter interleaves each head's two rotary halves; HF
weights use rotate-half order), as transformers' GGUF integration does.

Under tensor parallelism a rank dequantizes only its rows of a row-split
tensor (quantization blocks run along a row, so rows cut cleanly; the
permutation stays inside a head, and a rank's rows are whole heads); a
column-split tensor is dequantized whole on the host and cut there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from kvserve.distributed.sharding import Slice
from kvserve.model.config import ModelConfig
from kvserve.model.loaders.base import ResolvedModel, register_loader

if TYPE_CHECKING:
    from gguf import GGUFReader

    from kvserve.model.llama import LlamaForCausalLM

_SUPPORTED_GGUF_ARCHS = ("llama",)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF checkpoint name (unknown names pass through,
    so load_weights reports them as unexpected)."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, leaf = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{leaf}"
        return gguf_name
    stem, _, leaf = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[stem]}.{leaf}" if stem in _GLOBAL_NAMES else gguf_name


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True, eq=False)
class GGUFWeights:
    # The reader parsed while resolving the config; reopening costs seconds
    # (it parses the whole tokenizer vocabulary). Tensor data stays memory-mapped.
    reader: "GGUFReader"
    num_heads: int
    num_kv_heads: int

    def iter_weights(self, part_of: Callable[[str], Slice | None] = lambda name: None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float tensor) of every GGUF tensor, cut to `part_of(name)`."""
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            part = part_of(name)
            rows = (part.start, part.stop) if part is not None and part.dim == 0 else None
            weight = _dequantize(tensor, rows)
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                heads = self.num_heads if ".attn_q." in tensor.name else self.num_kv_heads
                head_dim = tensor.data.shape[0] // heads
                weight = unpermute_rope_rows(weight, weight.shape[0] // head_dim)
            if part is not None and part.dim == 1:
                weight = weight.narrow(1, part.start, part.length)
            yield name, weight

    def load_into(self, model: "LlamaForCausalLM") -> None:
        model.load_weights(self.iter_weights(model.checkpoint_slice))


def _dequantize(tensor: Any, rows: tuple[int, int] | None) -> torch.Tensor:
    """Float32 rows [start, stop) of a GGUF tensor (all rows when None)."""
    from gguf.quants import dequantize
    data = tensor.data if rows is None else tensor.data[rows[0]:rows[1]]
    array = dequantize(data, tensor.tensor_type)
    # F32 tensors come back as read-only views of the memory map.
    return torch.from_numpy(array if array.flags.writeable else array.copy())


@register_loader("gguf")
def resolve_gguf(model: str, hf_overrides: dict[str, Any] | None, with_tokenizer: bool = True) -> ResolvedModel:
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    config = ModelConfig.from_hf_config(hf_config_from_gguf(reader), hf_overrides)
    weights = GGUFWeights(reader, config.num_attention_heads, config.num_key_value_heads)
    return ResolvedModel(name=model, load_format="gguf", config=config,
                         weights=weights, tokenizer=_tokenizer(path) if with_tokenizer else None)


def hf_config_from_gguf(reader: "GGUFReader") -> dict[str, Any]:
    """An HF-style config dict from llama.cpp metadata keys."""
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(_SUPPORTED_GGUF_ARCHS)}")
    tensor_names = {t.name for t in reader.tensors}
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": [token for token in (
            _field(reader, "tokenizer.ggml.eos_token_id", None),
            _field(reader, "tokenizer.ggml.eot_token_id", None)) if token is not None],
    }


_MISSING = object()


def _field(reader: "GGUFReader", key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata is missing {key!r}")
        return default
    return field.contents()


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer  # heavy import, only when needed
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)
