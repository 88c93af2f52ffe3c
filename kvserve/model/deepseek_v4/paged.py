"""`PagedSequenceKV`: one request's V4 past read from, and written to, the
paged KV storage through its per-group block tables (layout: cache/v4_specs.py).

The storage is one tensor [num_blocks, unit]; group g views a block as
[layers_in_group, rows, width]. Positions map to (table slot, row) on the
shared token grid; entry w of a compressed group lives in the slot where its
window ends, at row w % entries_per_block.
"""
from __future__ import annotations

import torch

from kvserve.cache.v4_specs import V4KVLayout
from kvserve.model.deepseek_v4.state import LayerPast


class PagedSequenceKV:
    def __init__(self, storage: torch.Tensor, layout: V4KVLayout, tables: list[torch.Tensor], start: int,
                 rates: dict[str, int]) -> None:
        self.storage, self.layout, self.tables, self.start = storage, layout, tables, start
        self.rates = rates  # "csa" / "hca" -> compress rate

    def _view(self, kind: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-layer page view [num_blocks, rows, width], block table) of a kind."""
        group_id, g = self.layout.find(kind, layer)
        k = len(g.group.layer_ids)
        size = k * g.kind.rows * g.kind.width
        view = self.storage[:, :size].view(-1, k, g.kind.rows, g.kind.width)[:, g.slot(layer)]
        return view, self.tables[group_id]

    def _token_rows(self, kind: str, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        view, table = self._view(kind, layer)
        pos = torch.arange(lo, hi, device=view.device)
        B = self.layout.block_size
        return view, table[pos // B].long(), pos % B

    def _entry_rows(self, kind: str, layer: int, lo: int, hi: int, rate: int):
        view, table = self._view(kind, layer)
        w = torch.arange(lo, hi, device=view.device)
        B = self.layout.block_size
        return view, table[((w + 1) * rate - 1) // B].long(), w % max(1, B // rate)

    def past(self, layer: int, names: tuple[str, ...], like: torch.Tensor,
             dims: dict[str, tuple[int, int]]) -> LayerPast:
        p0 = self.start
        lo = self.layout.groups[self.layout.find("sliding", layer)[0]].kind.spec.visible_start(p0)
        view, blocks, rows = self._token_rows("sliding", layer, lo, p0)
        past = LayerPast(view[blocks, rows], lo, {}, {})
        prefix = self.layout.compressed_kind(layer)
        if prefix is None:
            return past
        rate = self.rates[prefix]
        first = max(0, (p0 // rate - (1 if prefix == "csa" else 0)) * rate)
        view, blocks, rows = self._token_rows(f"{prefix}_state", layer, first, p0)
        raw = view[blocks, rows]
        view, blocks, rows = self._entry_rows(f"{prefix}_entries", layer, 0, p0 // rate, rate)
        entries = view[blocks, rows]
        offset = 0
        for name in names:
            width, dim = dims[name]
            past.raw[name] = (raw[:, offset:offset + width], raw[:, offset + width:offset + 2 * width], first)
            offset += 2 * width
        past.entries["compressor"] = entries[:, :dims["compressor"][1]]
        if "indexer" in names:
            past.entries["indexer"] = entries[:, dims["compressor"][1]:]
        return past

    def append(self, layer: int, sliding_kv: torch.Tensor, raw: dict[str, tuple[torch.Tensor, torch.Tensor]],
               entries: dict[str, torch.Tensor]) -> None:
        p0, n = self.start, len(sliding_kv)
        view, blocks, rows = self._token_rows("sliding", layer, p0, p0 + n)
        view[blocks, rows] = sliding_kv
        prefix = self.layout.compressed_kind(layer)
        if prefix is None:
            return
        rate = self.rates[prefix]
        view, blocks, rows = self._token_rows(f"{prefix}_state", layer, p0, p0 + n)
        view[blocks, rows] = torch.cat([t for name in raw for t in raw[name]], dim=-1)
        new = torch.cat([entries[name] for name in entries], dim=-1)
        if len(new):
            first = p0 // rate
            view, blocks, rows = self._entry_rows(f"{prefix}_entries", layer, first, first + len(new), rate)
            view[blocks, rows] = new
