"""Which build of the Gluon prefill kernel each large eager step of a seed scenario takes, on a CPU.

The kernel has four builds (`HAS_PREFIX` x `LISTED`, `attention/kernels/prefill_gluon.py`); on a
cold Triton cache the first step to take a build the start-up warm-up did not launch compiles it
while requests wait (qa on an H100, 2026-12-06: 2.5 s in its third step, docs/BENCHMARKS.md).
Here the scenario runs through kvserve's scheduler on a stub model (no layers, no GPU), and
each step the CUDA dispatch would send to the Gluon kernel (an eager step of TMA_MIN_TOKENS
tokens or more, full attention, head_dim 128, on Hopper) is worked out from its host lengths
as `triton_backend.py` and `kernels/mixed.py` work it out there (the Gluon gates:
`_takes_fresh_kv`, `short_chunk_bound`, `_tma_prefill`, `gluon_tile_list`).

    python3 benchmarks/gluon_build_probe.py --model-dir .dummy-qwen3-8b --scenario qa

`--model-dir` gives the tokenizer (the prompts' token ids) only; `--group` and `--page` the
model's query heads per KV head and the KV block size (Qwen3-8B: 4 and 16).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_scenarios import DEFAULT_COUNTS, ENGINE_ARGS, scenario_requests  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.kernels import mixed  # noqa: E402
from kvserve.attention.kernels.prefill_gluon import count_tiles, takes_list  # noqa: E402

COLUMNS = "step rows one-query prompt_tokens max_q fresh_share min_q_len items HAS_PREFIX LISTED first"


def gluon_build(meta, group: int, page: int) -> tuple:
    """(fresh-key share, min_q_len, list items, HAS_PREFIX, LISTED) of the step's Gluon launch."""
    share = meta.fresh_key_share()
    cached = share < 1.0   # GLUON_MIN_FRESH_SHARE is 0: the chunks' own K/V always go in
    paged_below = max(mixed.TMA_SHORT_CHUNKS_PAGED_BELOW, page) if cached else 0
    min_q_len = max(paged_below if meta.longest_chunk_below(paged_below) else 0, 2)
    items = count_tiles(meta.query_lens_cpu, group, min_q_len)
    listed = takes_list(meta.max_query_len, len(meta.seq_lens_cpu), group, items)
    return round(share, 3), min_q_len, items, cached, listed


def stub_engine(block_size: int) -> LLM:
    """A tiny model of the scenario's vocabulary whose forward is zeros: the scheduler alone runs."""
    llm = LLM("dummy:tiny-llama", block_size=block_size, num_kv_blocks=30000,
              max_model_len=ENGINE_ARGS["max_model_len"], max_num_batched_tokens=ENGINE_ARGS["max_num_batched_tokens"],
              hf_overrides={"vocab_size": 152064, "max_position_embeddings": ENGINE_ARGS["max_model_len"]})
    runner, hidden = llm.engine.runner, llm.engine.model_config.hidden_size
    runner._forward = lambda inputs, *_: torch.zeros(inputs.meta.num_tokens, hidden)
    return llm


def record_builds(llm: LLM, group: int, page: int) -> list[tuple]:
    """Wraps the runner's `prepare`: one line a Gluon-bound step, appended as steps run."""
    runner, lines, seen = llm.engine.runner, [], set()
    prepare = runner.prepare

    def recording(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        meta = inputs.meta
        if meta.num_tokens >= mixed.TMA_MIN_TOKENS and not meta.is_decode_only:
            share, min_q_len, items, cached, listed = gluon_build(meta, group, page)
            lens = meta.query_lens_cpu
            lines.append((len(lines) + 1, len(lens), lens.count(1), sum(n for n in lens if n > 1),
                          meta.max_query_len, share, min_q_len, items, cached, listed,
                          (cached, listed) not in seen))
            seen.add((cached, listed))
        return inputs
    runner.prepare = recording
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--scenario", default="qa", choices=sorted(DEFAULT_COUNTS))
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--page", type=int, default=16)
    a = p.parse_args()
    llm = stub_engine(a.page)
    lines = record_builds(llm, a.group, a.page)
    for name, count in (("qa", 1), (a.scenario, DEFAULT_COUNTS[a.scenario])):   # offline_scenarios' order
        requests = scenario_requests(name, count, a.model_dir)
        llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                      [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
                      use_tqdm=False)
    print(COLUMNS)
    for line in lines:
        print(*line)


if __name__ == "__main__":
    main()
