"""Structured output: constraints compiled by xgrammar (compiler.py) and enforced per request by
a token bitmask on the logits (matcher.py; applied in engine/sampler.py).

The package exports the compiler's names only: they need no torch, and the tokenizer process,
which checks that a constraint compiles, never imports it (torch costs a process some 2 s and
300 MB to import). The matcher's (tensors) come from `minisgl.grammar.matcher`."""

from minisgl.grammar.compiler import (GrammarCache, GrammarError, TokenizerSource, choice_grammar,
                                      compile_structured, make_checker)

__all__ = ["GrammarCache", "GrammarError", "TokenizerSource", "choice_grammar",
           "compile_structured", "make_checker"]
