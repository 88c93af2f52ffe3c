"""The files of an HF model directory besides its weights: JSON configs and
the tokenizer. Shared by the safetensors loader, the dummy loader (which
takes a directory's shape and tokenizer) and the `tokenizer` override."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def tokenizer_in(directory: Path) -> Any | None:
    """The directory's tokenizer, or None when it holds no tokenizer files."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy import, only when needed
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def load_tokenizer(path: str) -> Any:
    """The tokenizer in directory `path` (the `tokenizer` engine argument)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer {path!r} is not a directory (pass a folder "
                                f"holding {' / '.join(TOKENIZER_FILES)})")
    tokenizer = tokenizer_in(directory)
    if tokenizer is None:
        raise FileNotFoundError(f"tokenizer directory {path!r} holds none of "
                                f"{', '.join(TOKENIZER_FILES)}")
    return tokenizer
