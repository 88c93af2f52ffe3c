"""HF checkpoint directories: config.json + one or many *.safetensors files
(+ optional tokenizer files and generation_config.json)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.loaders.base import ResolvedModel, register_loader
from kvserve.model.loaders.hf_files import read_json, tokenizer_in

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM

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
        read_json(config_path), hf_overrides,
        generation_config=read_json(directory / "generation_config.json"))
    return ResolvedModel(name=model, load_format="safetensors", config=config,
                         weights=SafetensorsWeights(files), tokenizer=tokenizer_in(directory))

