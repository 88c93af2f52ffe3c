"""Seeded synthetic workloads shaped like the SPEC's four scenarios.

Lengths are heavy-tailed (lognormal) around the SPEC's means, with a spread
per the SPEC's "length variance" column; `scale` shrinks every length (CPU
runs). Prompts are text built from a fixed word list in which almost every
word is one BPE token, so `length` words come out near `length` tokens on
Llama-style tokenizers; the server's `usage` reports the exact counts.

- qa: short independent questions.
- long-doc: one long document per request, then "summarize".
- code-review: conversations; turn k re-sends the whole history (file, the
  earlier questions and review replies) plus a new question, and must wait
  for turn k-1 to finish (`after`).
- ide-completion: ~48 shared file prefixes (Zipf-popular), each request adds
  a short cursor context.
- mixed: all four interleaved.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

SCENARIOS = ("qa", "long-doc", "code-review", "ide-completion")
WORKLOADS = SCENARIOS + ("mixed",)

# scenario -> (mean input tokens, mean output tokens, lognormal sigma)
SHAPES = {
    "qa": (128, 256, 0.25),
    "long-doc": (4217, 1893, 0.9),
    "code-review": (3152, 3021, 0.9),
    "ide-completion": (892, 127, 0.5),
}
MIXED_WEIGHTS = {"qa": 0.4, "ide-completion": 0.3, "long-doc": 0.15, "code-review": 0.15}
NUM_IDE_FILES = 48

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we their has would when if "
          "so no will more about can out up them some could into other then what only time like "
          "new these over also may after most such first well way make many even back any good "
          "through just where much before work should long life being both under never day same "
          "another know while last might great old year off come since against go came right "
          "used take three state world home small found part system data value model cache block "
          "page memory token layer window prefix request server queue batch step time rate").split()
_CODE = ("def", "return", "if", "else", "for", "in", "self", "None", "True", "import", "class",
         "x", "y", "value", "result", "items", "key", "index", "count", "total", "name", "data")


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    max_tokens: int
    scenario: str
    # Index of the request that must finish before this one is sent (multi-turn).
    after: int | None = None


class _Lengths:
    def __init__(self, rng: random.Random, scale: float, max_len: int) -> None:
        self.rng, self.scale, self.max_len = rng, scale, max_len

    def sample(self, mean: float, sigma: float, low: int = 1) -> int:
        """Lognormal with the given mean (after scaling), clipped to [low, max_len/2]."""
        mu = math.log(max(mean * self.scale, 1.0)) - sigma * sigma / 2
        value = int(round(self.rng.lognormvariate(mu, sigma)))
        return max(low, min(value, self.max_len // 2))


class WorkloadGenerator:
    def __init__(self, seed: int = 0, scale: float = 1.0, max_len: int = 8192) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.rng = random.Random(seed)
        self.lengths = _Lengths(self.rng, scale, max_len)
        self._files: list[str] | None = None

    def generate(self, workload: str, num_requests: int) -> list[WorkloadRequest]:
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        if workload == "mixed":
            requests = self._mixed(num_requests)
        elif workload == "code-review":
            requests = self._code_review(num_requests)
        else:
            make = {"qa": self._qa, "long-doc": self._long_doc, "ide-completion": self._ide}[workload]
            requests = [make() for _ in range(num_requests)]
        return [self._fit(r) for r in requests]

    def _fit(self, request: WorkloadRequest) -> WorkloadRequest:
        """Shorten max_tokens so prompt + output stays inside the context window."""
        room = self.lengths.max_len - _approx_tokens(request.prompt)
        if request.max_tokens <= room:
            return request
        return WorkloadRequest(request.prompt, max(1, room), request.scenario, request.after)

    # -- scenarios ---------------------------------------------------------------------
    def _qa(self) -> WorkloadRequest:
        mean_in, mean_out, sigma = SHAPES["qa"]
        question = self._words(self.lengths.sample(mean_in, sigma, low=4))
        return WorkloadRequest(f"Question: {question}?\nAnswer:", self.lengths.sample(mean_out, sigma), "qa")

    def _long_doc(self) -> WorkloadRequest:
        mean_in, mean_out, sigma = SHAPES["long-doc"]
        doc = self._paragraphs(self.lengths.sample(mean_in, sigma, low=16))
        prompt = f"Document:\n{doc}\n\nSummarize the document above."
        return WorkloadRequest(prompt, self.lengths.sample(mean_out, sigma), "long-doc")

    def _ide(self) -> WorkloadRequest:
        mean_in, mean_out, sigma = SHAPES["ide-completion"]
        files = self._ide_files()
        # Zipf-like popularity: a few files are being edited most of the time.
        weights = [1.0 / (rank + 1) for rank in range(len(files))]
        prefix = self.rng.choices(files, weights)[0]
        cursor = self._code(self.lengths.sample(0.2 * mean_in, sigma, low=2))
        return WorkloadRequest(prefix + cursor, self.lengths.sample(mean_out, sigma), "ide-completion")

    def _ide_files(self) -> list[str]:
        if self._files is None:
            mean_in, _, sigma = SHAPES["ide-completion"]
            self._files = [f"# file_{i}.py\n" + self._code(self.lengths.sample(0.8 * mean_in, sigma, low=8))
                           for i in range(NUM_IDE_FILES)]
        return self._files

    def _code_review(self, num_requests: int, first_index: int = 0) -> list[WorkloadRequest]:
        """Conversations of 2-5 turns, interleaved round-robin so turns of one
        conversation are spread out in time."""
        conversations: list[list[WorkloadRequest]] = []
        total = 0
        while total < num_requests:
            turns = self._conversation(min(self.rng.randint(2, 5), num_requests - total)) or [self._qa()]
            conversations.append(turns)
            total += len(turns)
        return _interleave(conversations, first_index)

    def _conversation(self, num_turns: int) -> list[WorkloadRequest]:
        mean_in, mean_out, sigma = SHAPES["code-review"]
        history = "Review this code:\n" + self._code(self.lengths.sample(0.5 * mean_in, sigma, low=16))
        turns = []
        for _ in range(num_turns):
            if _approx_tokens(history) > 0.6 * self.lengths.max_len:
                break  # the conversation outgrew the context window
            question = self._words(self.lengths.sample(0.05 * mean_in, 0.5, low=4))
            history += f"\nUser: {question}?\nReviewer:"
            turns.append(WorkloadRequest(history, self.lengths.sample(mean_out, sigma), "code-review"))
            # The next turn re-sends everything, including a (synthetic) review reply.
            history += " " + self._words(self.lengths.sample(0.15 * mean_in, sigma, low=4))
        return turns

    def _mixed(self, num_requests: int) -> list[WorkloadRequest]:
        names = list(MIXED_WEIGHTS)
        picks = self.rng.choices(names, [MIXED_WEIGHTS[n] for n in names], k=num_requests)
        # Review turns fill the review slots in order; `after` is remapped to slots.
        slots = [i for i, name in enumerate(picks) if name == "code-review"]
        reviews = iter(self._code_review(len(slots)))
        out: list[WorkloadRequest] = []
        for name in picks:
            if name != "code-review":
                out.append(self.generate(name, 1)[0])
                continue
            r = next(reviews)
            out.append(WorkloadRequest(r.prompt, r.max_tokens, r.scenario,
                                       None if r.after is None else slots[r.after]))
        return out

    # -- text ------------------------------------------------------------------------
    def _words(self, n: int) -> str:
        return " ".join(self.rng.choices(_WORDS, k=n))

    def _paragraphs(self, n: int) -> str:
        words = self.rng.choices(_WORDS, k=n)
        return "\n\n".join(" ".join(words[i:i + 60]) + "." for i in range(0, n, 60))

    def _code(self, n: int) -> str:
        tokens = self.rng.choices(_CODE, k=n)
        return "\n".join("    " + " ".join(tokens[i:i + 8]) for i in range(0, n, 8)) + "\n"


def _approx_tokens(text: str) -> int:
    # Measured on SmolLM2's tokenizer: ~1.15 tokens per word of these prompts.
    return int(len(text.split()) * 1.3) + 8


def _interleave(conversations: list[list[WorkloadRequest]], first_index: int) -> list[WorkloadRequest]:
    """Round-robin over conversations; each turn records its predecessor's index."""
    out: list[WorkloadRequest] = []
    last_index: dict[int, int] = {}
    depth = max((len(c) for c in conversations), default=0)   # mixed may pick no review at all
    for turn in range(depth):
        for c, turns in enumerate(conversations):
            if turn < len(turns):
                r = turns[turn]
                out.append(WorkloadRequest(r.prompt, r.max_tokens, r.scenario, last_index.get(c)))
                last_index[c] = first_index + len(out) - 1
    return out


def generate_workload(workload: str, num_requests: int, seed: int = 0, scale: float = 1.0,
                      max_len: int = 8192) -> list[WorkloadRequest]:
    return WorkloadGenerator(seed, scale, max_len).generate(workload, num_requests)
