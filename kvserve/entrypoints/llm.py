"""`LLM`: the offline API, with vLLM's surface (generate, chat, SamplingParams)."""
from __future__ import annotations

import gc
import weakref
from typing import Any, Sequence

from kvserve.config import EngineArgs
from kvserve.engine.gc_heap import freeze_startup_heap
from kvserve.engine.llm_engine import LLMEngine
from kvserve.inputs import template_messages
from kvserve.outputs import RequestOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 kv_cache_memory_gb: float | None = None, load_format: str = "auto", seed: int = 0,
                 hf_overrides: dict[str, Any] | None = None, tensor_parallel_size: int = 1,
                 **kwargs: Any) -> None:
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, device=device,
                          block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                          kv_cache_memory_gb=kv_cache_memory_gb, load_format=load_format, seed=seed,
                          hf_overrides=hf_overrides, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.engine = LLMEngine(args)
        # As vLLM's engine core does: the start-up heap (modules, blocks, graphs) frozen, so the
        # first full collection of a run does not walk it (kvserve/engine/gc_heap.py); thawed
        # when this LLM goes, so that a process building several frees each one's cycles.
        freeze_startup_heap()
        weakref.finalize(self, gc.unfreeze)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        # Validate everything before enqueuing anything: a bad prompt must not
        # leave half a batch running. A prompt's n choices are n requests.
        groups = [[self.engine.make_request(_prompt_value(p), choice, cache_salt=_cache_salt(p))
                   for choice in sp.choices()] for p, sp in zip(prompt_list, params)]
        outputs = self._run([r for group in groups for r in group], use_tqdm)
        return _merge_choices(outputs, [len(group) for group in groups])

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def _apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use generate() instead")
        ids = tok.apply_chat_template(template_messages(conversation), add_generation_prompt=add_generation_prompt,
                                      tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        for r in requests:
            self.engine.add_request(r)
        pending = {r.request_id for r in requests}
        bar = _progress(len(requests), use_tqdm)
        while pending:
            for request in self.engine.step():
                if request.is_finished and request.request_id in pending:
                    pending.discard(request.request_id)
                    bar.update(1)
            if not self.engine.has_unfinished_requests() and pending:
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        bar.close()
        return [self.engine.make_output(r) for r in requests]

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (GPU and host tier), as vLLM's `LLM` does;
        False, changing nothing, while requests still hold blocks."""
        return self.engine.kv_cache.reset_prefix_cache()


def _merge_choices(outputs: list[RequestOutput], sizes: list[int]) -> list[RequestOutput]:
    """One RequestOutput a prompt, as vLLM's: the first choice's request with every choice's
    completion, indexed 0 .. n - 1 in order."""
    merged, start = [], 0
    for size in sizes:
        group, start = outputs[start:start + size], start + size
        completions = [out.outputs[0] for out in group]
        for i, completion in enumerate(completions):
            completion.index = i
        group[0].outputs, group[0].finished = completions, all(out.finished for out in group)
        merged.append(group[0])
    return merged


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _prompt_value(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:   # vLLM's multi_modal_data and the like: refused, never dropped
            raise ValueError(f"prompt dict keys {unknown} are not supported (supported: {sorted(PROMPT_KEYS)})")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            return ids.tolist() if hasattr(ids, "tolist") else list(ids)   # an array: Python ints
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"prompt dicts need 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    raise ValueError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")


def _cache_salt(prompt: PromptType) -> str | None:
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", unit="req")
