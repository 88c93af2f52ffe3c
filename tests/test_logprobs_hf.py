"""Engine logprobs against `log_softmax` of an HF transformers forward pass
over the same tokens (a tiny random Llama checkpoint, float32 on CPU)."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests.tiny_models import random_prompts, save_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-lp") / "ckpt")


def hf_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float64 log-probabilities of each next token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf_log_softmax(llama_dir, temperature):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=8, max_model_len=128)
    prompt = random_prompts([13], seed=21)[0]
    params = SamplingParams(temperature=temperature, max_tokens=6, logprobs=3, seed=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(llama_dir, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 6
    cumulative = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top3 = row.topk(3).indices.tolist()
        assert set(entry) == set(top3) | {token}, step
        for tid, lp in entry.items():
            assert lp == pytest.approx(row[tid].item(), abs=2e-4), (step, tid)
        cumulative += row[token].item()
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)
