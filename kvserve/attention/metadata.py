"""Per-batch forward metadata passed explicitly from the runner to every
attention layer (never a module global).

Tokens of a batch are flattened: sequence i owns query tokens
`query_start_loc[i]:query_start_loc[i+1]`, at positions
`seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`. Each KV cache group (layers
sharing one attention spec) has its own block table and slot mapping, so a GPU
backend plugs in without the scheduler or cache knowing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PrefillTiles:
    """A fixed-length tile table for the varlen kernel under CUDA graphs:
    program p attends for query tile `q_tile[p]` of sequence `seq[p]`
    (int32 device tensors; seq -1 marks an idle program)."""
    seq: torch.Tensor
    q_tile: torch.Tensor


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    block_size: int
    # [num_seqs + 1] int32, cumulative query lengths (device tensor).
    query_start_loc: torch.Tensor
    # [num_seqs] int32, context length after this step (computed + new).
    seq_lens: torch.Tensor
    # Per group: [num_seqs, max_blocks] int32 block ids (0 = null block).
    block_tables: list[torch.Tensor]
    # Per group: [num_tokens] int64 cache slots (block_id * block_size + offset)
    # where the new K/V of each token is written.
    slot_mappings: list[torch.Tensor]
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop on the host (the torch reference).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Derived per-batch tensors a backend computes once and reuses in every
    # layer (masks, gather indices), keyed by whatever the backend needs.
    scratch: dict[Any, Any] = field(default_factory=dict)
    # Set only in captured mixed-step graphs: the varlen kernel's grid comes
    # from this table, not from the host lengths above (which are bounds there).
    prefill_tiles: PrefillTiles | None = None
    # Set only on decode steps with KVSERVE_CASCADE=1 (one full-attention KV group): the step's
    # shared-prefix groups (`kernels/cascade.py` CascadePlan), read once a group by the backend.
    cascade: Any = None
    # Set only in decode and mixed graphs (unless KVSERVE_DECODE_WORK=0): the step's work list
    # (`kernels/decode_work.py` DecodeWork; a mixed step's one-query rows), planned before each replay
    # and rewritten where it changed (`runner.cuda_graph.WorkLists`).
    decode_work: Any = None

    def fresh_key_share(self) -> float:
        """The prompt rows' causal work over their own chunks (about q_len^2 / 2 keys a
        sequence) as a share of their whole work (that plus q_len x cached prefix); 1.0
        with no prompt rows. Worked out once a step and kept in `scratch` (backends ask
        once a layer)."""
        if "fresh_key_share" not in self.scratch:
            fresh = cached = 0
            for q_len, seq_len in zip(self.query_lens_cpu, self.seq_lens_cpu):
                if q_len > 1:
                    fresh += q_len * q_len // 2
                    cached += q_len * (seq_len - q_len)
            self.scratch["fresh_key_share"] = fresh / (fresh + cached) if fresh + cached else 1.0
        return self.scratch["fresh_key_share"]

    def longest_chunk_below(self, bound: int) -> int:
        """The longest prompt chunk (query of 2+ tokens) shorter than `bound`; 0 if none.
        Kept in `scratch` once a step, as `fresh_key_share`."""
        key = ("longest_chunk_below", bound)
        if key not in self.scratch:
            self.scratch[key] = max((n for n in self.query_lens_cpu if 1 < n < bound), default=0)
        return self.scratch[key]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
