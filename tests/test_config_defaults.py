"""Scheduler defaults follow vLLM 0.26's choice per device (arg_utils:
1024 sequences and a 16384 / 8192 token budget on GPUs of >= 70 GiB except
A100s; 256 and 8192 elsewhere), and an explicit value always wins."""
import pytest

from kvserve.config import EngineArgs

GIB = 2**30


@pytest.mark.parametrize("memory, name, usage, seqs, budget", [
    (141 * GIB, "NVIDIA H200", "server", 1024, 8192),
    (141 * GIB, "NVIDIA H200", "llm", 1024, 16384),
    (80 * GIB, "NVIDIA A100-SXM4-80GB", "server", 256, 8192),
    (24 * GIB, "NVIDIA L4", "llm", 256, 8192),
    (0, "", "llm", 256, 8192),
])
def test_defaults_follow_the_device(memory, name, usage, seqs, budget):
    config = EngineArgs(usage=usage).scheduler_config(4096, memory, name)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (seqs, budget)


def test_explicit_values_win():
    config = EngineArgs(max_num_seqs=7, max_num_batched_tokens=99).scheduler_config(4096, 141 * GIB, "H200")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 99)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_max_num_seqs_names_the_value(bad):
    with pytest.raises(ValueError, match=f"max_num_seqs must be >= 1, got {bad}"):
        EngineArgs(max_num_seqs=bad).scheduler_config(4096)
