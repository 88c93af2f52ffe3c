"""Did a served run take every prefix-cache hit it could? Against a `kvserve bench serve --save-json`
run of token-id prompts, this rebuilds the workload's prompts (same workload, count, seed,
max_len and tokenizer), checks their lengths against the run's, and for each request in the
order it was sent counts the tokens of its longest full-block prefix that an earlier request's
prompt held (never the whole prompt: its last token is computed). That is the most any prefix
cache of that block size could have hit, with nothing evicted and no output reused; the run's
`cached_tokens` (the engine's usage figure) is set beside it, by scenario.

    python benchmarks/prefix_hits_check.py RUN.json --tokenizer MODEL_DIR [--block-size 16]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.bench.workloads import generate_workload  # noqa: E402


def possible_hits(prompts: list[list[int]], order: list[int], block: int) -> dict[int, int]:
    """Request index -> tokens of its longest full-block prefix an earlier-sent prompt held."""
    seen: set[tuple[int, ...]] = set()
    hits = {}
    for i in order:
        ids = prompts[i]
        full = len(ids) // block
        prefixes = [tuple(ids[:(b + 1) * block]) for b in range(full)]
        shared = next((b for b, p in enumerate(prefixes) if p not in seen), full)
        hits[i] = min(shared * block, (len(ids) - 1) // block * block)
        seen.update(prefixes)
    return hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    run = json.load(open(a.run))
    args, done = run["args"], run["requests"]
    requests = generate_workload(args["workload"], args["num_prompts"], args["seed"], args["scale"], args["max_len"])
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    prompts = tokenizer([r.prompt for r in requests], add_special_tokens=False)["input_ids"]
    if [len(ids) for ids in prompts] != [r["prompt_tokens"] for r in done]:
        sys.exit("the rebuilt prompts' lengths differ from the run's: another workload, seed or tokenizer")
    hits = possible_hits(prompts, sorted(range(len(done)), key=lambda i: done[i]["sent_s"]), a.block_size)
    rows = defaultdict(lambda: [0, 0, 0, 0])
    for i, r in enumerate(requests):
        row = rows[r.scenario]
        row[0] += 1
        row[1] += len(prompts[i])
        row[2] += hits[i]
        row[3] += done[i]["cached_tokens"] or 0
    print("| scenario | requests | prompt tokens | possible hits | the run's cached tokens |\n|---|---|---|---|---|")
    for scenario, (count, tokens, possible, cached) in rows.items():
        print(f"| {scenario} | {count} | {tokens} | {possible} | {cached} |")
    short = [i for i in hits if (done[i]["cached_tokens"] or 0) < hits[i]]
    print(f"requests with fewer cached tokens than possible: {len(short)}")


if __name__ == "__main__":
    main()
