"""Streaming detokenization cost on the embedded SmolLM2 tokenizer: full decode of
the output after every token (before) vs kvserve/detokenizer.py (after).

  python benchmarks/detokenize_bench.py [--tokens 2000]
"""
import argparse
import time

from kvserve.detokenizer import DetokenizerState, advance
from kvserve.model.loaders import resolve_model

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=2000)
args = ap.parse_args()
tok = resolve_model(None).tokenizer
text = ("In the beginning the engine decoded every token again. " * 400 + "naïve café 東京 🚀 ") * 2
ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
start = time.perf_counter()
for end in range(1, len(ids) + 1):
    full = tok.decode(ids[:end], skip_special_tokens=True)
full_s = time.perf_counter() - start
state, grown = DetokenizerState(), []  # the engine passes the growing output list itself
start = time.perf_counter()
for token in ids:
    grown.append(token)
    inc = advance(tok, state, grown)
inc_s = time.perf_counter() - start
assert inc == full
print(f"{len(ids)} tokens streamed one at a time: full decode each step {full_s:.2f} s "
      f"({full_s / len(ids) * 1e6:.0f} us/token), incremental {inc_s:.3f} s ({inc_s / len(ids) * 1e6:.0f} us/token)")
