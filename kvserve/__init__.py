"""kvserve: an LLM inference and serving engine built around a paged KV cache
that stays fast under mixed lengths, hybrid attention and heavy prefix reuse."""
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import kvserve` stays cheap (no torch model code) for the CLI's --help.
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
