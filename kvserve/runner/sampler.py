"""Token sampling on the logits' device: greedy, temperature, top-k, top-p,
min-p, per-request seeds, logprobs, and the logits processors (logit_bias,
min_tokens, presence / frequency / repetition penalties, grammar masks).

Everything that touches the vocabulary is one batched tensor op over the rows
that need it; Python loops run over rows only. Per-request state (seeded
generator, penalty counts slot, bias tensors, grammar matcher) is built on a
request's first sample, one row at a time: a row whose state cannot be built
raises `RequestFailed` naming it, so the engine fails that request alone.
One host transfer of ids per step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from operator import and_, attrgetter, or_

import torch

from kvserve.runner.staging import current_stream, upload
from kvserve.sampling_params import SamplingParams

UINT64_MASK = 2 ** 64 - 1


# Repetition penalties below this act as this (the API takes any r > 0, as vLLM's does). A positive
# logit divided by r ~1e-40 is inf in float32 (5e-324 rounds to 0), and softmax then gives NaN
# probabilities: a sampled row drew token 0. At 1e-28 a logit of 1e3 becomes 1e31, finite under
# any sampling temperature (>= 1e-5), and the seen tokens keep their order: the limit r -> 0.
REPETITION_FLOOR = 1e-28


class RequestFailed(Exception):
    """Sampling state for these requests could not be built; the others are fine."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"requests {request_ids} failed: {type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: logprob of the sampled token and the top-n alternatives (or None).
    logprobs: list[dict[int, float] | None]
    # Per row: the sampled token's logprob; None when no row asked for logprobs.
    sampled_logprobs: list[float | None]


class _RowState:
    """What one request's rows need across steps."""

    def __init__(self) -> None:
        self.generator: torch.Generator | None = None
        self.slot: int | None = None            # row of the penalty buffers
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.min_tokens_ban: torch.Tensor | None = None   # eos + stop ids, banned before min_tokens
        self.grammar = None                     # kvserve.structured.GrammarMatcher
        self.num_sampled = 0
        self.kind = 0   # what the row asks of a batch (`_kind`), set once its state is built


# A row's asks, as bits of `_RowState.kind`: a batch's plan ORs and ANDs them
# instead of reading every row's parameters (`_BatchPlan`).
GREEDY, PROCESSED, LOGPROBS, FILTERED, SEEDED, PENALIZED, COUNTED = (1 << i for i in range(7))


def _kind(params: SamplingParams, state: _RowState) -> int:
    """`state.kind` of a request with these (frozen) parameters and this state."""
    return ((GREEDY if params.is_greedy else 0)
            | (PROCESSED if params.needs_logits_processing else 0)
            | (LOGPROBS if params.logprobs is not None else 0)
            | (FILTERED if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0 else 0)
            | (SEEDED if state.generator is not None and not params.is_greedy else 0)
            | (PENALIZED if state.slot is not None else 0)
            | (COUNTED if state.min_tokens_ban is not None or state.grammar is not None else 0))


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._states: dict[str, _RowState] = {}
        # Requests the engine registered (prompt ids, eos ids for penalties / min_tokens).
        self._requests: dict[str, object] = {}
        self.penalties = PenaltyBuffers(device)
        self._grammar_masks = None   # kvserve.structured.grammar.GrammarMasks, on the first grammar
        self._plan: _BatchPlan | None = None   # the last batch's (`_plan_for`)

    def track(self, request) -> None:
        """Remember a request's prompt and eos ids (the engine calls this on intake)."""
        self._requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._plan = None   # it may hold this request's state; an id can come back
        state = self._states.pop(request_id, None)
        if state is not None and state.slot is not None:
            self.penalties.release(state.slot)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               request_ids: list[str]) -> "PendingSample":
        """Launch sampling; the ids stay on the device (`token_ids`) for the next
        step, and one packed copy heads to the host behind an event."""
        plan = self._plan_for(params, request_ids)
        processed = self._process(logits, params, plan.states, request_ids) if plan.needs_processing else logits
        if plan.all_greedy:
            ids = processed.argmax(dim=-1)  # argmax is exact in any float type: no upcast
        else:
            ids = self._sample_mixed(processed.float(), params, plan)
        self._after_sample(ids, plan)
        if plan.num_top is None:
            # Like vLLM, logprobs (cumulative ones too) cost nothing unless asked
            # for: no full-vocabulary log-softmax on the hot path.
            return PendingSample(ids, _to_host_async(ids), params, None)
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # raw logits, as vLLM's default
        columns = [ids.unsqueeze(1).double(), logprobs_all.gather(1, ids.unsqueeze(1)).double()]
        if plan.num_top:
            top_lp, top_ids = logprobs_all.topk(plan.num_top, dim=-1)
            columns += [top_ids.double(), top_lp.double()]
        # Token ids are exact in float64, so one tensor carries everything.
        return PendingSample(ids, _to_host_async(torch.cat(columns, dim=1)), params, plan.num_top)

    def _plan_for(self, params: list[SamplingParams], request_ids: list[str]) -> "_BatchPlan":
        """The batch's plan: the last one when these are the same requests in the
        same order (steady decode), else a new one."""
        plan = self._plan
        if plan is None or plan.request_ids != request_ids:
            plan = self._plan = _BatchPlan(request_ids, params, self._states_for(params, request_ids))
        return plan

    # -- per-request state -------------------------------------------------------
    def _states_for(self, params: list[SamplingParams], request_ids: list[str]) -> list[_RowState]:
        states, failed, cause = [], [], None
        for p, rid in zip(params, request_ids):
            state = self._states.get(rid)
            if state is None:
                try:
                    state = self._new_state(p, rid)
                except Exception as e:  # this request's fault: fail it alone
                    failed.append(rid)
                    cause = e
                    continue
                self._states[rid] = state
            states.append(state)
        if failed:
            raise RequestFailed(failed, cause)
        return states

    def _new_state(self, params: SamplingParams, request_id: str) -> _RowState:
        state, request = _RowState(), self._requests.get(request_id)
        if params.seed is not None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(params.seed & UINT64_MASK)
        if params.has_penalties:
            prompt = getattr(request, "prompt_token_ids", [])
            output = getattr(request, "output_token_ids", [])
            state.slot = self.penalties.acquire(prompt, output)
        if params.logit_bias:
            state.bias_ids = upload(torch.tensor(list(params.logit_bias), dtype=torch.long), self.device)
            state.bias_values = upload(torch.tensor(list(params.logit_bias.values()),
                                                    dtype=torch.float32), self.device)
        if params.min_tokens > 0:
            banned = set(getattr(request, "eos_token_ids", ())) | set(params.stop_token_ids or ())
            state.min_tokens_ban = upload(torch.tensor(sorted(banned), dtype=torch.long), self.device)
        if params.structured is not None:
            state.grammar = params.structured.new_matcher()
        state.num_sampled = len(getattr(request, "output_token_ids", []))
        state.kind = _kind(params, state)
        return state

    # -- logits processors ----------------------------------------------------------
    def _process(self, logits: torch.Tensor, params: list[SamplingParams],
                 states: list[_RowState], request_ids: list[str] | None = None) -> torch.Tensor:
        """Logits after bias, min_tokens, grammar and penalties (a copy; the raw
        logits stay for logprobs). Untouched when no row asks for any."""
        if not any(p.needs_logits_processing for p in params):
            return logits
        x = logits.to(torch.float32, copy=True)
        _add_at(x, [(i, s.bias_ids, s.bias_values) for i, s in enumerate(states) if s.bias_ids is not None])
        banned = [(i, s.min_tokens_ban, None) for i, (p, s) in enumerate(zip(params, states))
                  if s.min_tokens_ban is not None and s.num_sampled < p.min_tokens]
        _add_at(x, banned, fill=float("-inf"))
        grammar_rows = [(i, s.grammar) for i, s in enumerate(states) if s.grammar is not None]
        if grammar_rows:
            from kvserve.structured.grammar import GrammarMasks, RowsFailed
            if self._grammar_masks is None:
                self._grammar_masks = GrammarMasks()
            try:
                self._grammar_masks.apply(x, grammar_rows)
            except RowsFailed as e:
                raise RequestFailed([(request_ids or [])[i] for i in e.rows], e.cause) from e
        penalized = [(i, p, s.slot) for i, (p, s) in enumerate(zip(params, states)) if s.slot is not None]
        if penalized:
            self.penalties.apply(x, penalized)
        return x

    def _after_sample(self, ids: torch.Tensor, plan: "_BatchPlan") -> None:
        if plan.penalty_rows:
            self.penalties.count(ids, plan.penalty_rows)
        for i, state in plan.counted:
            state.num_sampled += 1
            if state.grammar is not None:
                state.grammar.sampled(ids, i)

    def _sample_mixed(self, logits: torch.Tensor, params: list[SamplingParams],
                      plan: "_BatchPlan") -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        scaled = logits / plan.tensor("temps", lambda: _temperatures(params, logits.device))
        if plan.filters:   # a full-vocabulary sort: only when asked for
            scaled = _filter_logits(scaled, params, plan)
        probs = torch.softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws from p. Seeded rows
        # redraw their noise from their own generator, so their samples do not
        # depend on what else shares the batch.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, generator in plan.seeded:
            noise[i].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = plan.tensor("is_greedy", lambda: upload(torch.tensor([p.is_greedy for p in params]),
                                                            logits.device))
        return torch.where(is_greedy, greedy, sampled)


_kind_of = attrgetter("kind")


class _BatchPlan:
    """What one batch's rows ask for, worked out when the batch changes: steady
    decode samples the same requests in the same order step after step, so
    these per-row passes and their uploads run once, not every step.
    `num_sampled` is counted only for the rows that read it (min_tokens)."""

    def __init__(self, request_ids: list[str], params: list[SamplingParams], states: list[_RowState]) -> None:
        self.request_ids, self.states = request_ids, states
        # The rows' kinds (`_kind`): in a server the batch changes nearly every step,
        # and reading each row's parameters here cost ~200 us a step at 256 rows.
        kinds = set(map(_kind_of, states))
        every, some = functools.reduce(and_, kinds, -1), functools.reduce(or_, kinds, 0)
        self.all_greedy = bool(every & GREEDY)
        self.needs_processing = bool(some & PROCESSED)
        self.num_top = max(p.logprobs or 0 for p in params) if some & LOGPROBS else None
        self.filters = bool(some & FILTERED)
        self.seeded = [(i, s.generator) for i, s in enumerate(states) if s.kind & SEEDED] if some & SEEDED else []
        self.penalty_rows = [(i, s.slot) for i, s in enumerate(states) if s.kind & PENALIZED] \
            if some & PENALIZED else []
        self.counted = [(i, s) for i, s in enumerate(states) if s.kind & COUNTED] if some & COUNTED else []
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, build) -> torch.Tensor:
        """The batch's device tensor `name`, built on first use."""
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = build()
        return t


def _temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params]), device).unsqueeze(1)


class PendingSample:
    """A launched sampling step: device ids now, host values on `resolve()`.

    `num_top` None: the host tensor holds only the ids (nobody asked for logprobs)."""

    def __init__(self, token_ids: torch.Tensor, host: tuple[torch.Tensor, torch.cuda.Event | None],
                 params: list[SamplingParams], num_top: int | None) -> None:
        self.token_ids = token_ids
        self._host, self._ready = host
        self._params = params
        self._num_top = num_top

    def resolve(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        if self._num_top is None:
            ids = self._host.tolist()
            return SamplerOutput(ids, [None] * len(ids), [None] * len(ids))
        rows = self._host.tolist()
        logprobs: list[dict[int, float] | None] = []
        for row, p in zip(rows, self._params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            entry = {int(row[0]): row[1]}
            top = list(zip(row[2:2 + self._num_top], row[2 + self._num_top:]))
            for tid, lp in top[:p.logprobs]:
                entry.setdefault(int(tid), lp)
            logprobs.append(entry)
        return SamplerOutput([int(r[0]) for r in rows], logprobs, [r[1] for r in rows])


def _to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start a device->host copy into pinned memory; the event marks its end."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(current_stream(t.device))
    return host, event


def _filter_logits(logits: torch.Tensor, params: list[SamplingParams], plan: _BatchPlan) -> torch.Tensor:
    """Apply top-k, top-p and min-p per row (rows not asking are untouched)."""
    neg_inf = torch.finfo(logits.dtype).min
    vocab, device = logits.shape[-1], logits.device
    top_k = plan.tensor("top_k", lambda: upload(
        torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]), device))
    top_p = plan.tensor("top_p", lambda: upload(torch.tensor([p.top_p for p in params]), device))
    min_p = plan.tensor("min_p", lambda: upload(torch.tensor([p.min_p for p in params]), device))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop |= sorted_probs < (min_p.unsqueeze(1) * sorted_probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _add_at(x: torch.Tensor, rows: list[tuple[int, torch.Tensor, torch.Tensor | None]],
            fill: float | None = None) -> None:
    """x[row, ids] += values (or = fill) for every (row, ids, values), in one op."""
    if not rows:
        return
    row_idx = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids, _ in rows])
    row_idx = upload(row_idx, x.device)
    ids = torch.cat([ids for _, ids, _ in rows])
    if fill is not None:
        x.index_put_((row_idx, ids), torch.tensor(fill, device=x.device))
    else:
        x.index_put_((row_idx, ids), torch.cat([v for _, _, v in rows]), accumulate=True)


class PenaltyBuffers:
    """Output-token counts and prompt-token masks of penalized requests, one
    row (slot) each, on the device: counts are updated from the sampled ids on
    the device, so a token still in flight (pipelined steps) is counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None       # [capacity, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [capacity, vocab] bool
        self.capacity = 0
        self._free: list[int] = []
        self._fresh: list[tuple[int, list[int], list[int]]] = []  # slots to reset

    def acquire(self, prompt: list[int], output: list[int]) -> int:
        if not self._free:
            grown = max(8, 2 * self.capacity)
            self._free = list(range(grown - 1, self.capacity - 1, -1))
            self.capacity = grown
        slot = self._free.pop()
        self._fresh.append((slot, list(prompt), list(output)))
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def apply(self, x: torch.Tensor, rows: list[tuple[int, SamplingParams, int]]) -> None:
        """vLLM's penalties: repetition divides positive / multiplies negative
        logits of prompt-or-output tokens; frequency and presence subtract from
        output tokens by count / once."""
        self._materialize(x.shape[1])
        idx = upload(torch.tensor([i for i, _, _ in rows], dtype=torch.long), x.device)
        slots = upload(torch.tensor([s for _, _, s in rows], dtype=torch.long), x.device)
        values = upload(torch.tensor([[max(p.repetition_penalty, REPETITION_FLOOR), p.frequency_penalty,
                                       p.presence_penalty] for _, p, _ in rows], dtype=torch.float32), x.device)
        rep, freq, pres = (values[:, k:k + 1] for k in range(3))
        counts = self.counts[slots].float()
        seen = (counts > 0) | self.prompt_mask[slots]
        sub = x[idx]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        x[idx] = sub - freq * counts - pres * (counts > 0).float()

    def count(self, ids: torch.Tensor, rows: list[tuple[int, int]]) -> None:
        """Add this step's sampled ids to their rows' counts (on the device)."""
        idx = upload(torch.tensor([i for i, _ in rows], dtype=torch.long), ids.device)
        slots = upload(torch.tensor([s for _, s in rows], dtype=torch.long), ids.device)
        ones = torch.ones(len(rows), dtype=torch.int32, device=ids.device)
        self.counts.index_put_((slots, ids[idx]), ones, accumulate=True)

    def _materialize(self, vocab: int) -> None:
        """Allocate or grow the buffers, then reset the slots acquired since."""
        have = 0 if self.counts is None else self.counts.shape[0]
        if have < self.capacity:
            counts = torch.zeros(self.capacity, vocab, dtype=torch.int32, device=self.device)
            mask = torch.zeros(self.capacity, vocab, dtype=torch.bool, device=self.device)
            if have:
                counts[:have], mask[:have] = self.counts, self.prompt_mask
            self.counts, self.prompt_mask = counts, mask
        for slot, prompt, output in self._fresh:
            self.counts[slot].zero_()
            self.prompt_mask[slot].zero_()
            if prompt:
                self.prompt_mask[slot, _ids_on(prompt, self.device)] = True
            if output:
                ids = _ids_on(output, self.device)
                self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._fresh.clear()


def _ids_on(ids: list[int], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(ids, dtype=torch.long), device)
