"""Token sampling on the logits' device: greedy, temperature, top-k, top-p,
min-p, per-request seeds, and logprobs. One host transfer of ids per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.runner.batch import upload
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: logprob of the sampled token and the top-n alternatives (or None).
    logprobs: list[dict[int, float] | None]
    # Per row: the sampled token's logprob; None when no row asked for logprobs.
    sampled_logprobs: list[float | None]


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # Seeded requests own a generator so their samples do not depend on
        # what else shares the batch.
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               request_ids: list[str]) -> "PendingSample":
        """Launch sampling; the ids stay on the device (`token_ids`) for the next
        step, and one packed copy heads to the host behind an event."""
        if all(p.is_greedy for p in params):
            ids = logits.argmax(dim=-1)  # argmax is exact in any float type: no upcast
        else:
            ids = self._sample_mixed(logits.float(), params, request_ids)
        if all(p.logprobs is None for p in params):
            # Like vLLM, logprobs (cumulative ones too) cost nothing unless asked
            # for: no full-vocabulary log-softmax on the hot path.
            return PendingSample(ids, _to_host_async(ids), params, None)
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        want = max((p.logprobs or 0) for p in params)
        columns = [ids.unsqueeze(1).double(), logprobs_all.gather(1, ids.unsqueeze(1)).double()]
        if want:
            top_lp, top_ids = logprobs_all.topk(want, dim=-1)
            columns += [top_ids.double(), top_lp.double()]
        # Token ids are exact in float64, so one tensor carries everything.
        return PendingSample(ids, _to_host_async(torch.cat(columns, dim=1)), params, want)

    def _sample_mixed(self, logits: torch.Tensor, params: list[SamplingParams],
                      request_ids: list[str]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        temps = upload(torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params]),
                       logits.device).unsqueeze(1)
        probs = torch.softmax(_filter_logits(logits / temps, params), dim=-1)
        ids = torch.empty_like(greedy)
        for i, (p, rid) in enumerate(zip(params, request_ids)):
            if p.is_greedy:
                ids[i] = greedy[i]
            else:
                ids[i] = torch.multinomial(probs[i], 1, generator=self._generator_for(p, rid))[0]
        return ids

    def _generator_for(self, params: SamplingParams, request_id: str) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._request_generators[request_id] = gen
        return gen



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
    event.record()
    return host, event


def _filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p per row (rows not asking are untouched)."""
    neg_inf = torch.finfo(logits.dtype).min
    vocab = logits.shape[-1]
    top_k = upload(torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]), logits.device)
    top_p = upload(torch.tensor([p.top_p for p in params]), logits.device)
    min_p = upload(torch.tensor([p.min_p for p in params]), logits.device)
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
