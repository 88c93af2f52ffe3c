"""Greedy generation for V4 over per-request `DenseSequenceKV` pasts: every
step batches each prompt's next chunk (at most `chunk_size` tokens, so chunks
split compression windows anywhere) with the other requests' decode tokens."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.model.deepseek_v4.model import DeepseekV4ForCausalLM
from kvserve.model.deepseek_v4.state import DenseSequenceKV


@torch.inference_mode()
def greedy_generate(model: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    chunk_size: int = 1 << 30) -> list[list[int]]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    stores = [DenseSequenceKV() for _ in prompts]
    target = [len(p) + max_new_tokens for p in prompts]
    device = model.head.weight.device
    while any(len(t) < n for t, n in zip(tokens, target)):
        active = [i for i in range(len(tokens)) if len(tokens[i]) < target[i]]
        lens = [min(chunk_size, len(tokens[i]) - computed[i]) for i in active]
        ids = torch.tensor([t for i, n in zip(active, lens) for t in tokens[i][computed[i]:computed[i] + n]],
                           device=device)
        pos = torch.tensor([p for i, n in zip(active, lens) for p in range(computed[i], computed[i] + n)],
                           device=device)
        hidden = model.forward_tokens(ids, pos, lens, [stores[i] for i in active])
        ends = torch.tensor(lens).cumsum(0) - 1
        next_ids = model.compute_logits(hidden[ends.to(device)]).argmax(-1).tolist()
        for i, n, tok in zip(active, lens, next_ids):
            computed[i] += n
            if computed[i] == len(tokens[i]):  # the chunk finished the known tokens: sample
                tokens[i].append(tok)
    return [t[len(p):] for t, p in zip(tokens, prompts)]
