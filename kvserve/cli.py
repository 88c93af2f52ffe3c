"""The `kvserve` command line: generate, chat, serve, bench, diagnose, profile."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine (vLLM's names)."""
    p.add_argument("--model", default=None, help="HF dir, .gguf file, or dummy:<shape> (default: embedded SmolLM2-135M)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: random weights of a dummy:<shape> or of an HF directory's config.json")
    p.add_argument("--tokenizer", default=None, help="HF directory whose tokenizer replaces the model's")
    p.add_argument("--hf-overrides", type=_json_object, default=None,
                   help='JSON object merged into the model config, e.g. \'{"max_position_embeddings": 4096}\'')
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per step (default as vLLM's: 1024 on GPUs of >= 70 GiB, else 256)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.0,
                   help="host-memory KV tier for evicted prefix blocks and swapped requests (0: off)")
    p.add_argument("--eviction-policy", default="reuse", choices=["lru", "reuse"],
                   help="GPU prefix-block eviction order (reuse: leaves first, never-hit blocks first)")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    p.add_argument("--kv-rotation-interval", type=int, default=0,
                   help="at the tail of a burst, rotate KV-blocked requests in every N steps (0: off)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "prefix"],
                   help="admission order (prefix: requests sharing a running request's prefix may go first)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many tokens of one request a step (vLLM's flag; 0: off)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs of this host to split the model over (one process each)")
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(model=a.model, load_format=a.load_format, tokenizer=a.tokenizer,
                hf_overrides=a.hf_overrides, dtype=a.dtype, device=a.device,
                block_size=a.block_size, enable_prefix_caching=a.enable_prefix_caching,
                max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                max_model_len=a.max_model_len, num_kv_blocks=a.num_kv_blocks,
                kv_cache_memory_gb=a.kv_cache_memory_gb, gpu_memory_utilization=a.gpu_memory_utilization,
                enforce_eager=a.enforce_eager, seed=a.seed, cpu_kv_cache_gb=a.cpu_kv_cache_gb,
                eviction_policy=a.eviction_policy, preemption_mode=a.preemption_mode,
                kv_rotation_interval=a.kv_rotation_interval,
                scheduling_policy=a.scheduling_policy, tensor_parallel_size=a.tensor_parallel_size,
                long_prefill_token_threshold=a.long_prefill_token_threshold)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _sampling(a: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_tokens, seed=a.sampling_seed)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)


def cmd_generate(a: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM
    llm = LLM(**engine_kwargs(a))
    tok = llm.get_tokenizer()
    if not a.raw and tok is not None and getattr(tok, "chat_template", None):
        # Instruct models answer a question only inside their chat template.
        conversations = [[{"role": "user", "content": p}] for p in a.prompts]
        outputs = llm.chat(conversations, _sampling(a), use_tqdm=len(a.prompts) > 1)
    else:
        outputs = llm.generate(a.prompts, _sampling(a), use_tqdm=len(a.prompts) > 1)
    for out in outputs:
        print(out.outputs[0].text if len(outputs) == 1 else f"[{out.request_id}] {out.outputs[0].text}")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM
    llm = LLM(**engine_kwargs(a))
    history: list[dict[str, str]] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("kvserve chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    for line in _user_lines():
        line = line.strip()
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, _sampling(a), use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def _user_lines():
    """Lines from a pipe, or prompted lines from a terminal until Ctrl-D."""
    if not sys.stdin.isatty():
        yield from sys.stdin
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print the results")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--raw", action="store_true",
                     help="complete the text as is (default: wrap it in the model's chat template, if any)")
    add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat through the model's chat template")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    from kvserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    _add_serve_parser(sub)
    from kvserve.diagnose.cli import add_diagnose_parser, add_profile_parser
    add_diagnose_parser(sub)
    add_profile_parser(sub)
    return parser


def _add_serve_parser(sub: Any) -> None:
    try:
        from kvserve.server.cli import add_serve_parser
    except ImportError:
        return
    add_serve_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
