"""Two engines' runs of one workload, request by request: mean TTFT by the second a request was
sent in, when the requests sent in the first SECONDS got their first tokens (a burst: whose
prefill kept up), and the spacing of their first-token groups (each engine's step time). Both
files are `kvserve bench serve --save-json` results of the same workload, seed and count, so
request i is the same prompt in both.

    python benchmarks/serve_compare_requests.py A.json B.json [SECONDS]
"""
from __future__ import annotations

import json
import statistics
import sys

from kvserve.engine.step_trace import percentile


def load(path: str) -> list[dict]:
    """A result file's per-request records; one that is not a result file is a ValueError naming it."""
    try:
        with open(path) as f:
            return json.load(f)["requests"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a `kvserve bench serve --save-json` result ({e!r})") from None


def by_second(a: list[dict], b: list[dict]) -> list[str]:
    lines = ["| sent in second | requests | TTFT mean A ms | TTFT mean B ms |", "|---|---|---|---|"]
    for second in sorted({int(r["sent_s"]) for r in a}):
        pairs = [(x, y) for x, y in zip(a, b) if int(x["sent_s"]) == second and x["ok"] and y["ok"]]
        if pairs:
            lines.append(f"| {second} | {len(pairs)} | {statistics.mean(x['ttft_ms'] for x, _ in pairs):.0f} | "
                         f"{statistics.mean(y['ttft_ms'] for _, y in pairs):.0f} |")
    return lines


def first_tokens(requests: list[dict], seconds: float) -> str:
    done = sorted(r["sent_s"] + r["ttft_ms"] / 1e3 for r in requests if r["sent_s"] < seconds and r["ok"])
    if not done:
        return "no request sent in that time"
    return (f"{len(done)} requests sent in the first {seconds:g} s: first tokens by p50 {percentile(done, 0.5):.2f} s, "
            f"p90 {percentile(done, 0.9):.2f} s, last {done[-1]:.2f} s")


def first_token_spacing(requests: list[dict], seconds: float) -> str:
    """First tokens of a burst come in groups, one a prefill step: the median spacing of those
    groups (a new group after a 30 ms lull; spacings of 100-400 ms, a full step's) reads each
    engine's step time from the client's side."""
    done = sorted(r["sent_s"] + r["ttft_ms"] / 1e3 for r in requests if r["sent_s"] < seconds and r["ok"])
    starts = [t for i, t in enumerate(done) if i == 0 or t - done[i - 1] > 0.03]
    steps = [b - a for a, b in zip(starts, starts[1:]) if 0.1 < b - a < 0.4]
    if not steps:
        return "no full-step spacing between first-token groups"
    return f"{len(starts)} first-token groups, median spacing of full steps {statistics.median(steps) * 1e3:.0f} ms"


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__)
        return 2
    try:
        a, b = load(argv[0]), load(argv[1])
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 1
    if [r["prompt_tokens"] for r in a] != [r["prompt_tokens"] for r in b]:
        print("error: the two runs did not send the same prompts (workload, seed or count differ)")
        return 1
    seconds = float(argv[2]) if len(argv) == 3 else 5.0
    print("\n".join(by_second(a, b)))
    print(f"A: {first_tokens(a, seconds)}\nB: {first_tokens(b, seconds)}")
    print(f"A: {first_token_spacing(a, seconds)}\nB: {first_token_spacing(b, seconds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
