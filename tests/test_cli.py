"""The `kvserve` command line: generate prints a completion, bad input exits 2
with a message naming the value."""
from __future__ import annotations

from kvserve.cli import main
from tests.tiny_models import save_tiny_checkpoint


def test_generate_prints_completion(capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["generate", "The capital of France is", "--max-tokens", "6", "--raw"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_bad_input_exits_with_clear_error(capsys, tmp_path):
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens must be at least 1, got 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    # --served-model-name takes several names: a model path after it would become one.
    assert main(["serve", "--served-model-name", "m", str(tmp_path)]) == 2
    assert "put the model path before --served-model-name" in capsys.readouterr().err


def test_bench_throughput_runs(capsys, tmp_path):
    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    assert main(["bench", "throughput", "--model", str(path), "--num-prompts", "3", "--input-len", "12",
                 "--output-len", "5", "--repeats", "1", "--baseline", "hf"]) == 0
    out = capsys.readouterr().out
    assert "kvserve" in out and "hf-transformers" in out and "ratio kvserve / hf-transformers" in out


def test_serve_can_turn_the_access_log_off(monkeypatch):
    """vLLM's `--disable-uvicorn-access-log` reaches uvicorn; the log stays on by default."""
    import uvicorn

    import kvserve.server.app as app_module
    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    monkeypatch.setattr(app_module, "build_app", lambda *a, **kw: object())
    assert main(["serve", "--disable-uvicorn-access-log"]) == 0
    assert main(["serve"]) == 0
    assert [kw["access_log"] for kw in runs] == [False, True]

