"""Which DeepSeek V4 kernel builds a growing context asks for: a census of launch signatures.

Triton builds a kernel once per signature: its constexprs, and for each specialised int argument
whether it is 1 or a multiple of 16. A served prompt whose context grows chunk by chunk may ask
for a new signature at some chunks, and each new one compiles inside that step (seconds on a
cold Triton cache). This script runs one CSA and one HCA layer's indexer and attention host code
on meta tensors (nothing executes; every launch is recorded, not run) at V4-Flash attention
shapes, over the contexts given, and prints the distinct signatures per kernel and what varies
between them. The block tables are as wide as the engine's (a multiple of 16 entries,
`cache/block_table_rows.py`).

    python benchmarks/v4_launch_variants.py                      # chunks 512 and 8192, contexts to 128K
    python benchmarks/v4_launch_variants.py --chunks 8192 --contexts 8192:65536:8192
    python benchmarks/v4_launch_variants.py --model --chunks 1 7 16 100 256 1000 8192 --contexts 1:131072:4099
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.cache.block_table_rows import WIDTH_STEP  # noqa: E402
from kvserve.cache.v4_specs import V4KVLayout  # noqa: E402
from kvserve.model.deepseek_v4 import kernels  # noqa: E402
from kvserve.model.deepseek_v4.kernels import PageRef, V4PagedBatch  # noqa: E402

D, DI, H, HI, TOPK, WINDOW, CSA_RATE, HCA_RATE, BLOCK = 512, 128, 64, 64, 512, 128, 4, 128, 16
META = torch.device("meta")


def _signature(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple:
    """What Triton keys a build on, of one launch: constexprs, each specialised int's 1 / multiple of
    16, and each tensor's start alignment (a meta tensor's data_ptr is 0: its offset tells)."""
    values = dict(zip(kernel.arg_names, args)) | kwargs
    sig = []
    for param in kernel.params:
        value = values.get(param.name)
        if isinstance(value, torch.Tensor):
            sig.append((param.name, "16B" if value.storage_offset() * value.element_size() % 16 == 0 else "unaligned"))
        elif param.is_constexpr or isinstance(value, bool):
            sig.append((param.name, value))
        elif isinstance(value, int) and not param.do_not_specialize:
            sig.append((param.name, "1" if value == 1 else "16k" if value % 16 == 0 else "int"))
    return tuple(sig + [(k, kwargs[k]) for k in ("num_warps", "num_stages") if k in kwargs])


@contextlib.contextmanager
def recorded_launches():
    """Within: every Triton launch records its signature in the yielded dict (kernel name ->
    set of signatures) instead of running."""
    seen: dict[str, set] = defaultdict(set)
    original = JITFunction.__getitem__

    def launcher(kernel, grid):
        return lambda *args, **kwargs: seen[kernel.fn.__name__].add(_signature(kernel, args, kwargs))
    JITFunction.__getitem__ = launcher
    try:
        yield seen
    finally:
        JITFunction.__getitem__ = original


def _table_width(context: int) -> int:
    """Block-table entries for `context` tokens, as wide as the engine's (`block_table_rows.WIDTH_STEP`)."""
    blocks = -(-context // BLOCK)
    return -(-blocks // WIDTH_STEP) * WIDTH_STEP


def pages(context: int) -> tuple[V4PagedBatch, PageRef, PageRef, PageRef]:
    """(a one-token batch, sliding, CSA and HCA entry pages) at `context`, the tables as wide as the
    engine's (a multiple of 16 entries)."""
    table = torch.empty(4, _table_width(context), dtype=torch.int32, device=META)
    storage = torch.empty(16, BLOCK * (D + DI) * 2, dtype=torch.bfloat16, device=META)
    batch = V4PagedBatch(storage, V4KVLayout(BLOCK, storage.shape[1], ()), [table] * 3,
                         torch.empty(1, dtype=torch.int32, device=META), torch.empty(1, dtype=torch.int64, device=META),
                         context)
    return (batch, PageRef(table, 0, BLOCK, D), PageRef(table, BLOCK * D, BLOCK // CSA_RATE, D + DI),
            PageRef(table, 0, 1, D))


def layer_step(num_tokens: int, context: int) -> None:
    """A CSA and an HCA layer's indexer and attention for `num_tokens` tokens ending at `context`."""
    one, sliding, csa, hca = pages(context)
    batch = V4PagedBatch(one.storage, one.layout, one.block_tables, torch.empty(num_tokens, dtype=torch.int32,
                         device=META), torch.empty(num_tokens, dtype=torch.int64, device=META), context)
    q = torch.empty(num_tokens, H, D, dtype=torch.bfloat16, device=META)
    sinks = torch.empty(H, device=META)
    index = kernels.index_top_k(torch.empty(num_tokens, HI, DI, dtype=torch.bfloat16, device=META),
                                torch.empty(num_tokens, HI, device=META), csa, D, batch, CSA_RATE, TOPK)
    kernels.sparse_attention(q, sliding, csa, index, sinks, D ** -0.5, WINDOW, CSA_RATE, batch, torch.empty_like(q))
    kernels.sparse_attention(q, sliding, hca, None, sinks, D ** -0.5, WINDOW, HCA_RATE, batch, torch.empty_like(q))


def model_census(sizes: list[int], contexts: list[int], model: str = "deepseek-v4-flash-l8") -> dict[str, set]:
    """Distinct launch signatures per kernel of whole-model steps (every layer, the kernel path) of
    each token count in `sizes` at each context, on a meta-tensor model: what served steps of those
    sizes ask Triton to build. The Gluon attention records as on a 132-SM Hopper."""
    from kvserve.cache.v4_specs import v4_kv_layout
    from kvserve.model.deepseek_v4 import loader
    from kvserve.model.deepseek_v4.kernels import sparse_decode_gluon as gluon
    net = loader._build(loader.dummy_config(model, {}), torch.bfloat16, "meta")
    net.place_rope_tables(META)
    for module in net.modules():
        if hasattr(module, "backend"):
            module.backend = "triton"   # the MoE's kernel path (on CUDA by default)
    layout = v4_kv_layout(net.config, BLOCK)
    storage = torch.empty(16, layout.unit, dtype=torch.bfloat16, device=META)
    supports, sm_count = gluon.supports, gluon.sm_count
    gluon.supports, gluon.sm_count = (lambda *args: True), (lambda device: 132)
    try:
        with recorded_launches() as seen, torch.inference_mode():
            for n in sizes:
                for context in (c for c in contexts if c >= n):
                    _model_step(net, layout, storage, n, context)
    finally:
        gluon.supports, gluon.sm_count = supports, sm_count
    return dict(seen)


def _model_step(net, layout, storage: torch.Tensor, num_tokens: int, context: int) -> None:
    """One step of `num_tokens` tokens over up to 4 sequences, the longest `context` tokens."""
    seqs = min(num_tokens, 4)
    tables = [torch.empty(seqs, _table_width(context), dtype=torch.int32, device=META) for _ in layout.groups]
    ids = torch.empty(num_tokens, dtype=torch.long, device=META)
    positions = torch.empty(num_tokens, dtype=torch.long, device=META)
    batch = V4PagedBatch(storage, layout, tables, torch.empty(num_tokens, dtype=torch.int32, device=META), positions,
                         context)
    net.forward_tokens(ids, positions, [], [], batch)


def census(chunks: list[int], contexts: list[int]) -> dict[str, set]:
    """Distinct launch signatures per kernel over every (chunk, context) step."""
    with recorded_launches() as seen:
        for chunk in chunks:
            for context in contexts:
                layer_step(min(chunk, context), context)
    return dict(seen)


def varying(signatures: set) -> dict[str, list[str]]:
    """The signature fields that differ between a kernel's signatures, and their values."""
    rows = [dict(s) for s in signatures]
    names = {n for row in rows for n in row}
    values = {n: sorted({str(row.get(n)) for row in rows}) for n in names}
    return {n: v for n, v in sorted(values.items()) if len(v) > 1}


def _range(text: str) -> list[int]:
    start, stop, step = map(int, text.split(":"))
    return list(range(start, stop + 1, step))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--contexts", type=_range, default=_range("1000:131072:777"),
                        help="start:stop:step of the steps' contexts (default 1000:131072:777)")
    parser.add_argument("--model", action="store_true",
                        help="whole-model steps of each --chunks token count (every kernel of the forward)")
    args = parser.parse_args(argv)
    print(f"chunks {args.chunks}, {len(args.contexts)} contexts {args.contexts[0]}..{args.contexts[-1]}")
    print("| kernel | builds | what varies |\n|---|---:|---|")
    found = (model_census if args.model else census)(args.chunks, args.contexts)
    for name, signatures in sorted(found.items()):
        print(f"| `{name}` | {len(signatures)} | {varying(signatures) or '-'} |")


if __name__ == "__main__":
    main()
