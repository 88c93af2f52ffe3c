"""`kvserve/outputs.py`: prompt logprob rows turned into vLLM's dicts, written out by hand
(the prompt token first, then the top-N it is not among, each with its rank and text; a
lost row stays None), and a completion's finished flag."""
from __future__ import annotations

from kvserve.outputs import CompletionOutput, Logprob, PromptLogprobRow, prompt_logprobs_of


def test_prompt_logprob_rows_become_vllms_dicts_with_every_entrys_text():
    rows = [PromptLogprobRow(-0.5, 2, [7, 11, 13], [-0.1, -0.5, -2.0]),   # 11 is the prompt token
            None,                                                        # a row lost to an engine error
            PromptLogprobRow(-3.0, 9, [4, 5], [-0.2, -0.9])]
    got = prompt_logprobs_of([1, 11, 12, 8], rows, decode=lambda t: f"<{t}>")
    assert got == [
        None,
        {11: Logprob(-0.5, 2, "<11>"), 7: Logprob(-0.1, 1, "<7>"), 13: Logprob(-2.0, 3, "<13>")},
        None,
        {8: Logprob(-3.0, 9, "<8>"), 4: Logprob(-0.2, 1, "<4>"), 5: Logprob(-0.9, 2, "<5>")}]
    assert list(got[1]) == [11, 7, 13]   # the prompt token first, then rank order


def test_without_a_decoder_no_entry_has_text():
    got = prompt_logprobs_of([1, 2], [PromptLogprobRow(-1.0, 1, [2, 3], [-1.0, -2.0])])
    assert got == [None, {2: Logprob(-1.0, 1, None), 3: Logprob(-2.0, 2, None)}]


def test_a_completion_is_finished_once_it_has_a_reason():
    output = CompletionOutput(0, "", [], None, None)
    assert not output.finished()
    output.finish_reason = "length"
    assert output.finished()
