"""The offline API's chat and text inputs, checked as the server checks them
(`kvserve/inputs.py`): text content parts are joined, as vLLM's `LLM.chat`
takes them (they raised TypeError in the template); null content, other part
types and lone surrogates are ValueErrors naming the message and the place,
not the template's or the tokenizer's own errors."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.inputs import template_messages

PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_text_parts_are_the_joined_string(llm):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    joined = "What is the capital of France?"
    by_parts = llm.chat([{"role": "user", "content": parts}], PARAMS, use_tqdm=False)[0]
    by_string = llm.chat([{"role": "user", "content": joined}], PARAMS, use_tqdm=False)[0]
    assert by_parts.prompt_token_ids == by_string.prompt_token_ids
    assert by_parts.outputs[0].token_ids == by_string.outputs[0].token_ids


@pytest.mark.parametrize("messages,error", [
    ([{"role": "user", "content": None}], "messages[0].content is required for role 'user'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
     "messages[1].content is required unless the message has tool_calls"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}],
     "messages[0].content[0]: parts of type 'image_url' are not supported (text only)"),
    ([{"role": "user", "content": []}], "messages[0].content must be a string or a non-empty list of text parts, got []"),
    ([{"role": "user", "content": "a\udc00"}], "messages[0].content holds a lone surrogate (U+DC00): not valid Unicode"),
])
def test_a_bad_message_is_a_value_error_naming_it(llm, messages, error):
    with pytest.raises(ValueError) as raised:
        llm.chat(messages, PARAMS, use_tqdm=False)
    assert str(raised.value) == error


def test_a_text_prompt_with_a_lone_surrogate_is_a_value_error(llm):
    with pytest.raises(ValueError, match=r"^prompt holds a lone surrogate \(U\+D800\): not valid Unicode$"):
        llm.generate("a\ud800b", PARAMS, use_tqdm=False)
    assert llm.generate("a\U0001F600b", PARAMS, use_tqdm=False)[0].outputs[0].token_ids   # a valid pair is fine


def test_template_messages_keep_the_other_keys_and_blank_a_tool_calling_turn():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                 "name": "u"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert template_messages(messages) == [{"role": "user", "content": "ab", "name": "u"},
                                           {"role": "assistant", "content": "", "tool_calls": [call]}]
