"""HF checkpoint directories: config.json + one or many *.safetensors files
(+ optional tokenizer files and generation_config.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.loaders.base import ResolvedModel, register_loader

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class SafetensorsWeights:
    files: tuple[Path, ...]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def load_into(self, model: "LlamaForCausalLM") -> None:
        model.load_weights(self.iter_weights())


@register_loader("safetensors")
def resolve_safetensors(model: str, hf_overrides: dict[str, Any] | None) -> ResolvedModel:
    directory = Path(model)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model!r} has no config.json")
    files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model!r} has no *.safetensors files")
    config = ModelConfig.from_hf_config(
        _read_json(config_path), hf_overrides,
        generation_config=_read_json(directory / "generation_config.json"))
    return ResolvedModel(name=model, load_format="safetensors", config=config,
                         weights=SafetensorsWeights(files), tokenizer=_tokenizer(directory))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _tokenizer(directory: Path) -> Any | None:
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy import, only when needed
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
