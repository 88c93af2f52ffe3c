"""Sampling defaults from a model's generation_config.json, applied as vLLM
does (`--generation-config auto`): a field the request leaves unset takes the
model's value; `vllm` uses the engine's own defaults."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config key -> SamplingParams field (vLLM's list).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str | None, mode: str = "auto") -> dict[str, Any]:
    if mode not in ("auto", "vllm"):
        path = Path(mode)
        if not path.is_dir():
            raise ValueError(f"--generation-config must be auto, vllm or a folder, got {mode!r}")
        return _read(path / "generation_config.json")
    if mode == "vllm" or model is None or not Path(model).is_dir():
        return {}  # the embedded and GGUF models carry no generation_config.json
    return _read(Path(model) / "generation_config.json")


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    from kvserve.sampling_params import SamplingParams
    SamplingParams(**{k: v for k, v in defaults.items()})  # bad values fail at start-up, not per request
    return defaults
