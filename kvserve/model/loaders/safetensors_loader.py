"""HF checkpoint directories: config.json + one or many *.safetensors files
(+ optional tokenizer files and generation_config.json).

Under tensor parallelism each rank reads only its part of every tensor
(safetensors slices the memory-mapped file)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from safetensors import safe_open

from kvserve.distributed.sharding import Slice
from kvserve.model.config import ModelConfig
from kvserve.model.loaders.base import ResolvedModel, register_loader
from kvserve.model.loaders.hf_files import read_json, tokenizer_in

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM

@dataclass(frozen=True)
class SafetensorsWeights:
    files: tuple[Path, ...]

    def iter_weights(self, part_of: Callable[[str], Slice | None] = lambda name: None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every checkpoint tensor, cut to `part_of(name)` when it names a part."""
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    part = part_of(name)
                    yield name, f.get_tensor(name) if part is None else _read_part(f.get_slice(name), part)

    def load_into(self, model: "LlamaForCausalLM") -> None:
        model.load_weights(self.iter_weights(model.checkpoint_slice))


def _read_part(view: Any, part: Slice) -> torch.Tensor:
    index = (slice(None),) * part.dim + (slice(part.start, part.stop),)
    return view[index]


@register_loader("safetensors")
def resolve_safetensors(model: str, hf_overrides: dict[str, Any] | None,
                        with_tokenizer: bool = True) -> ResolvedModel:
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
                         weights=SafetensorsWeights(files),
                         tokenizer=tokenizer_in(directory) if with_tokenizer else None)

