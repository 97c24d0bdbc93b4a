"""Structured output: constraints compiled by xgrammar (compiler.py) and enforced per request by
a token bitmask on the logits (matcher.py; applied in engine/sampler.py)."""

from minisgl.grammar.compiler import (GrammarCache, GrammarError, TokenizerSource, choice_grammar,
                                      compile_structured, make_checker)
from minisgl.grammar.matcher import RequestGrammar, fill_bitmask, full_bitmask

__all__ = ["GrammarCache", "GrammarError", "TokenizerSource", "choice_grammar",
           "compile_structured", "make_checker", "RequestGrammar", "fill_bitmask", "full_bitmask"]
