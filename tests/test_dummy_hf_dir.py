"""`load_format="dummy"` with an HF directory: the directory's config shape
(hf_overrides applied) and tokenizer, seeded random weights instead of its
safetensors; `tokenizer=` replaces a model's tokenizer; the CLI flags
--load-format / --tokenizer / --hf-overrides reach the engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.cli import build_parser, engine_kwargs, main
from kvserve.entrypoints.llm import LLM
from kvserve.model.loaders import resolve_model
from kvserve.model.loaders.dummy import DummyWeights
from kvserve.sampling_params import SamplingParams
from tests.tiny_models import save_tiny_checkpoint

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello engine",
          "paged attention keeps blocks of keys and values"]


def _save_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint with weights and a tokenizer."""
    path = save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def shape_only(checkpoint, tmp_path_factory) -> Path:
    """The same directory without weights: config.json + tokenizer files only."""
    path = tmp_path_factory.mktemp("shape") / "qwen3-shape"
    path.mkdir()
    for f in checkpoint.iterdir():
        if f.suffix != ".safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    return path


def _params(llm: LLM) -> dict[str, torch.Tensor]:
    return dict(llm.engine.runner.model.named_parameters())


def test_dummy_takes_the_directory_shape_and_tokenizer(checkpoint, shape_only):
    real = resolve_model(str(checkpoint), "safetensors")
    dummy = resolve_model(str(shape_only), "dummy")
    assert dummy.load_format == "dummy" and isinstance(dummy.weights, DummyWeights)
    assert dummy.config == real.config
    assert dummy.tokenizer.get_vocab() == real.tokenizer.get_vocab()
    assert dummy.tokenizer.eos_token == "<eos>"


def test_dummy_weights_have_the_checkpoint_shapes_not_its_values(checkpoint, shape_only):
    real = _params(LLM(str(checkpoint), num_kv_blocks=40))
    dummy = _params(LLM(str(shape_only), load_format="dummy", num_kv_blocks=40))
    again = _params(LLM(str(shape_only), load_format="dummy", num_kv_blocks=40))
    assert {n: p.shape for n, p in dummy.items()} == {n: p.shape for n, p in real.items()}
    matrices = [n for n, p in real.items() if p.dim() == 2]
    assert matrices and all(not torch.equal(dummy[n], real[n]) for n in matrices)
    assert all(torch.equal(dummy[n], again[n]) for n in dummy)  # seeded


def test_a_directory_draws_like_vllm_a_named_shape_keeps_unit_norms(shape_only):
    """A directory is the path for comparing engines: its weights follow vLLM's dummy
    distribution, every parameter Uniform(-1e-3, 1e-3), norms included."""
    drawn = _params(LLM(str(shape_only), load_format="dummy", num_kv_blocks=40))
    for name, param in drawn.items():
        assert param.abs().max().item() <= 1e-3, name
        assert param.std().item() > 4e-4, name   # spread over the interval (its std is 5.8e-4), not constant
    named = _params(LLM("dummy:tiny-qwen3", load_format="dummy", num_kv_blocks=40, max_model_len=64))
    norms = [n for n in named if n.endswith("norm.weight")]
    assert norms and all(torch.equal(named[n], torch.ones_like(named[n])) for n in norms)
    assert 0.015 < named["model.layers.0.mlp.down_proj.weight"].std().item() < 0.025


def test_dummy_directory_serves_text_with_its_tokenizer(shape_only):
    llm = LLM(str(shape_only), load_format="dummy", num_kv_blocks=40)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    expected = llm.get_tokenizer().encode("hello world", add_special_tokens=False)
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 4


def test_hf_overrides_reshape_the_dummy_model(shape_only):
    llm = LLM(str(shape_only), load_format="dummy", num_kv_blocks=40,
              hf_overrides={"num_hidden_layers": 2, "intermediate_size": 96})
    config = llm.engine.model_config
    assert (config.num_hidden_layers, config.intermediate_size) == (2, 96)
    assert len(llm.engine.runner.model.model.layers) == 2


def test_tokenizer_argument_replaces_the_models(shape_only):
    llm = LLM("dummy:tiny-llama", tokenizer=str(shape_only), num_kv_blocks=40)
    assert llm.get_tokenizer().encode("hello engine", add_special_tokens=False) == \
        PreTrainedTokenizerFast.from_pretrained(shape_only).encode("hello engine", add_special_tokens=False)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM("dummy:tiny-llama", tokenizer=str(shape_only / "config.json"))


def test_missing_pieces_are_named(shape_only, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(str(shape_only))  # auto: a directory means safetensors
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), "dummy")
    with pytest.raises(ValueError, match="unknown dummy model"):
        resolve_model("dummy:no-such-shape", "dummy")
    with pytest.raises(FileNotFoundError, match="holds none of"):
        resolve_model("dummy:tiny-llama", "dummy", tokenizer=str(tmp_path))


def test_cli_flags_reach_the_engine_args(shape_only):
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(shape_only), "--load-format", "dummy",
        "--tokenizer", str(shape_only), "--hf-overrides", '{"num_hidden_layers": 2}'])
    kwargs = engine_kwargs(args)
    assert (kwargs["load_format"], kwargs["tokenizer"]) == ("dummy", str(shape_only))
    assert kwargs["hf_overrides"] == {"num_hidden_layers": 2}
    assert kwargs["long_prefill_token_threshold"] == 0   # off unless asked
    args = build_parser().parse_args(["serve", "--long-prefill-token-threshold", "256"])
    assert engine_kwargs(args)["long_prefill_token_threshold"] == 256


def test_cli_generate_with_a_dummy_directory(shape_only, capsys):
    assert main(["generate", "hello world", "--raw", "--model", str(shape_only), "--load-format", "dummy",
                 "--hf-overrides", json.dumps({"num_hidden_layers": 2}), "--max-tokens", "3",
                 "--num-kv-blocks", "40"]) == 0
    capsys.readouterr()
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "x", "--hf-overrides", bad])
        assert "--hf-overrides" in capsys.readouterr().err
