"""Does a TMA box taller than its tensor fault? 17-row and 256-row K through the warm-up's launch."""
import torch
from kvserve.attention.kernels.prefill_tma import prefill_attention_tma
for rows in (256, 17):
    q = torch.zeros(17, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, 9, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    tables = torch.arange(1, 9, dtype=torch.int32, device="cuda").view(2, 4)
    starts = torch.tensor([0, 1, 17], dtype=torch.int32, device="cuda")
    lens = torch.full((2,), 64, dtype=torch.int32, device="cuda")
    k = torch.zeros(rows, 8, 128, dtype=torch.bfloat16, device="cuda")
    try:
        prefill_attention_tma(q, k, k, cache, torch.empty_like(q), tables, starts, lens, 16, 0.1, single_queries=False)
        torch.cuda.synchronize()
        print(f"K rows {rows}: ok")
    except Exception as e:
        print(f"K rows {rows}: {type(e).__name__}: {str(e)[:80]}")
