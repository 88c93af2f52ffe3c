"""Write a dummy model directory both engines can serve with random weights:
config.json of a named kvserve dummy shape plus the embedded SmolLM2
tokenizer, with the vocabulary cut to the tokenizer's (49,152), so token-id
prompts and detokenization are real on both sides.

Usage: python benchmarks/make_dummy_model.py qwen3-8b DIR
Serve it with `kvserve serve --model DIR --load-format dummy` and
`vllm.entrypoints.openai.api_server --model DIR --load-format dummy`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvserve.model.loaders import embedded_gguf_path
from kvserve.model.loaders.dummy import DUMMY_CONFIGS

# HF model_type of each architecture (vLLM's AutoConfig needs it).
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
               "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def main(shape: str, out: str) -> None:
    from transformers import AutoTokenizer
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    config = dict(DUMMY_CONFIGS[shape], vocab_size=len(tokenizer),
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  torch_dtype="bfloat16")
    config["model_type"] = MODEL_TYPES[config["architectures"][0]]
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(path))
    print(f"wrote {path}: {shape} shape, vocab {len(tokenizer)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
