"""The offline API's `n`: a prompt's n choices come back as one RequestOutput with n completions
(vLLM's shape), choice i sampled as a request of its own seeded `child_seed(seed, i)` would be."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import INT64_MAX, child_seed
from tests.tiny_models import random_prompts, save_tiny_checkpoint

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts([7, 12])]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")
    return LLM(str(path), dtype="float32", device="cpu")


def _tokens(llm, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("seed", [5, INT64_MAX])
def test_each_choice_is_the_request_its_seed_makes(llm, seed):
    params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.index for c in out.outputs] for out in outs] == [[0, 1, 2]] * 2
    assert all(out.finished and all(c.finish_reason == "length" for c in out.outputs) for out in outs)
    alone = [_tokens(llm, SamplingParams(temperature=1.0, seed=child_seed(seed, i), max_tokens=6, ignore_eos=True))
             for i in range(3)]
    assert [[c.token_ids for c in out.outputs] for out in outs] == [[alone[i][p][0] for i in range(3)]
                                                                    for p in range(2)]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1   # seeds differ, so do samples


def test_greedy_choices_agree_and_n_per_prompt_is_its_own(llm):
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=5, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = _tokens(llm, [greedy, one])
    assert len(got[0]) == 2 and got[0][0] == got[0][1] and len(got[1]) == 1
    assert got[0][0] == _tokens(llm, one)[0][0]
