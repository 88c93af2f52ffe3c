"""Incremental detokenization equals the full decode, token by token, for a
byte-level BPE (GPT-2 / Llama 3 / Qwen style: characters split over byte
tokens) and a Metaspace BPE (SentencePiece style: a decode drops the leading
space of its first token). Both tokenizers are trained here, offline."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.detokenizer import DetokenizerState, advance

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "Hello, world! Numbers 123 4567 and symbols: ½ ∑ ∫ — naïve café.",
          "東京タワーは高い。 Emoji are rare 🚀 🔥 and split over bytes.",
          "  leading spaces,\nnew lines\n\n\tand tabs"]
TEXTS = CORPUS + ["Unseen words: zyxw quartz, 🚀🔥🦊 ünïcødé ✓✓ 漢字かな交じり文", " a", "\n\n"]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<eos>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request):
    return _byte_level() if request.param == "byte-level" else _metaspace()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_tracks_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = ids[:len(ids) // 2] + [eos] + ids[len(ids) // 2:]  # a skipped special token inside
    state = DetokenizerState()
    for end in range(1, len(ids) + 1):
        text_so_far = advance(tokenizer, state, ids[:end])
        full = tokenizer.decode(ids[:end], skip_special_tokens=True)
        assert full.startswith(text_so_far), (end, text_so_far, full)
        # Held back at most an incomplete character's tokens.
        assert len(full.rstrip("\ufffd")) - len(text_so_far) <= 8
    assert text_so_far == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_held_back_until_complete():
    tokenizer = _byte_level()
    ids = tokenizer.encode("🦊", add_special_tokens=False)  # unseen: split over byte tokens
    assert len(ids) > 1
    state = DetokenizerState()
    texts = [advance(tokenizer, state, ids[:end]) for end in range(1, len(ids) + 1)]
    assert texts == [""] * (len(ids) - 1) + ["🦊"]


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decoder_equals_the_tokenizers_decode(tokenizer, clean_up):
    """The Rust backend is called directly only where transformers' decode would
    return the same text: with clean-up of tokenization spaces, the wrapper stays."""
    import random
    from kvserve.detokenizer import decoder, fast_backend
    before, tokenizer.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces, clean_up
    fast_backend.cache_clear()
    decode = decoder(tokenizer)
    assert (fast_backend(tokenizer) is tokenizer._tokenizer) == (not clean_up)
    rng = random.Random(0)
    special = tokenizer.convert_tokens_to_ids("<eos>")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids.insert(rng.randrange(len(ids) + 1), special)
        for start in range(0, len(ids), 3):
            assert decode(ids[start:]) == tokenizer.decode(ids[start:], skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = before
    fast_backend.cache_clear()


def test_the_decoder_calls_the_rust_backend_not_the_wrapper(monkeypatch):
    """Where the backend gives the same text, the wrapper's decode (~3x the backend's
    cost, twice a streamed token) is not called at all."""
    from kvserve.detokenizer import decoder, fast_backend
    tokenizer = _byte_level()
    tokenizer.clean_up_tokenization_spaces = False
    fast_backend.cache_clear()
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("the wrapper's decode was called"))
    assert decoder(tokenizer)(ids) == want
    fast_backend.cache_clear()
