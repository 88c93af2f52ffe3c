"""The loader interface: what resolving a model name yields, and the registry.

A loader turns a model reference (directory, .gguf file, `dummy:` name) into a
`ResolvedModel`: the validated config, a weight source and an optional
tokenizer. Reading weights is deferred to `WeightSource.load_into` so the
runner can size the KV cache and build the module before any tensor is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvserve.model.config import ModelConfig

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM


class WeightSource(Protocol):
    def load_into(self, model: "LlamaForCausalLM") -> None:
        """Fill every parameter of `model` (already on its device and dtype)."""
        ...


@dataclass(frozen=True)
class ResolvedModel:
    name: str                 # what the user passed (or the embedded model's path)
    load_format: str          # the concrete format: safetensors, gguf, dummy
    config: ModelConfig
    weights: WeightSource
    tokenizer: Any | None     # a transformers tokenizer, or None (dummy, no files)


# (model, hf_overrides, with_tokenizer): a tensor-parallel worker passes
# with_tokenizer=False (it never tokenizes; a GGUF tokenizer takes seconds to build).
Resolver = Callable[[str, "dict[str, Any] | None", bool], ResolvedModel]
_LOADERS: dict[str, Resolver] = {}


def register_loader(name: str) -> Callable[[Resolver], Resolver]:
    def wrap(resolver: Resolver) -> Resolver:
        _LOADERS[name] = resolver
        return resolver
    return wrap


def get_loader(name: str) -> Resolver:
    if name not in _LOADERS:
        raise ValueError(f"unknown load_format {name!r}; available: "
                         f"{', '.join(['auto', *sorted(_LOADERS)])}")
    return _LOADERS[name]
