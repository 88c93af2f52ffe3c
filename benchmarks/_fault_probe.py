"""Which launch faults in the no-compile test: run it with parts of the TMA path switched off."""
import sys
import torch
from kvserve.attention.kernels import mixed, warmup
from tests import test_attention_warmup as t
mode = sys.argv[1]
if mode in ("no-tma", "no-warm-tma"):
    warmup._warm_tma = lambda *a, **k: 0
if mode == "no-tma":
    mixed.TMA_MIN_TOKENS = 1 << 30
try:
    t.test_no_compile_after_warmup_for_any_eager_split_plan()
    torch.cuda.synchronize()
    print(mode, "passed")
except BaseException as e:  # noqa: BLE001
    print(mode, "failed:", type(e).__name__, str(e)[:100].replace("\n", " "))
