"""Structured output: grammars compiled with xgrammar (an optional dependency,
imported lazily), one matcher per request, token masks applied in the sampler."""
from kvserve.structured.grammar import GrammarCompilerPool, StructuredSpec

__all__ = ["GrammarCompilerPool", "StructuredSpec"]
