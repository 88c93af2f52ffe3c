"""The lm_head product's formulations timed per batch size (kvserve/model/logits_gemm.py), for
a head of each given vocabulary size x hidden 4,096 in bf16 (49,152: the embedded SmolLM2
tokenizer the dummy Qwen3-8B directory carries; 151,936: Qwen3's own).

    python3 benchmarks/lm_head_bench.py [--vocab 49152 151936] [--max-rows 256]
"""
import argparse

import torch

from kvserve.model.logits_gemm import LogitsPlan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--max-rows", type=int, default=256)
    a = p.parse_args()
    for vocab in a.vocab:
        weight = torch.randn(vocab, a.hidden, dtype=torch.bfloat16, device="cuda")
        plan = LogitsPlan.tune(weight, a.max_rows, reps=20)
        gb = weight.numel() * weight.element_size() / 1e9
        rows = sorted(next(iter(plan.timings_ms.values())))
        print(f"vocab {vocab} x {a.hidden} ({gb:.2f} GB): device us per call; rows per block (0: one product)")
        print("     M " + "".join(f"{r:>10}" for r in rows) + "     chosen   GB/s")
        for m, t in plan.timings_ms.items():
            best = plan.rows_by_bucket[m]
            print(f"{m:6d} " + "".join(f"{t[r] * 1e3:10.1f}" for r in rows) + f"{best:>11} {gb / t[best] * 1e3:6.0f}")
        del weight


if __name__ == "__main__":
    main()
