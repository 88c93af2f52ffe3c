"""KV bytes per token of context for DeepSeek V4-Flash dims: kvserve's
per-group layout (`kvserve/cache/v4_specs.py`, bf16 values) against vLLM
0.26's packed layout, computed from its published page sizes
(../shared/peers/deepseek_v4.md: 256-token blocks, every block id costs
47,808 B per layer whichever group holds it, FP8 entries).

    python benchmarks/v4_kv_bytes.py [block_size]
"""
from __future__ import annotations

import sys

import kvserve.cache.compressed_managers  # noqa: F401
from kvserve.cache.v4_specs import v4_kv_layout
from kvserve.model.deepseek_v4.loader import dummy_config

VLLM_BLOCK_BYTES = 47_808  # per layer, per 256-token block id
CONTEXTS = (8192, 65536, 1 << 20)


def vllm_packed_bytes(config, context: int) -> float:
    csa = sum(t.startswith("compressed") for t in config.layer_types)
    hca = sum(t.startswith("heavily") for t in config.layer_types)
    per_256 = (2 * csa + hca) * -(-context // 256)  # CSA: entries + indexer blocks; HCA: entries
    # decode reservations: (window - 1 + 1) / page tokens + 1 blocks per sliding / state group layer
    windows = config.num_hidden_layers * (128 // 64 + 1) + csa * (8 // 4 + 1) + hca * (128 // 8 + 1)
    return (per_256 + windows) * VLLM_BLOCK_BYTES


def main(block_size: int = 16) -> None:
    config = dummy_config("deepseek-v4-flash")
    layout = v4_kv_layout(config, block_size)
    print(f"block_size={block_size}, unit={layout.unit * 2} B, groups={len(layout.groups)}")
    print("| context | kvserve per-group (bf16) | vLLM packed (FP8) |")
    print("|---|---|---|")
    for n in CONTEXTS:
        print(f"| {n:,} | {layout.bytes_per_token(n, 2):,.0f} B/token | {vllm_packed_bytes(config, n) / n:,.0f} B/token |")
    ours = 100e9 // (layout.bytes_per_token(65536, 2) * 65536)
    theirs = 100e9 // vllm_packed_bytes(config, 65536)
    print(f"| 64K sequences in 100 GB | {ours:.0f} | {theirs:.0f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
