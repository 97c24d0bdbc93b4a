"""Compiling structured-output constraints with xgrammar, cached by (kind, spec).

Two kinds of owner build a `GrammarCache`: the tokenizer process (and `LLM`), which compiles a
request's constraint once to refuse what cannot compile before the request reaches a scheduler
(`check`), and every scheduler rank, which compiles it again for its own matchers (`submit`, in a
worker thread, so a compilation never stalls the decode loop). Compilation is a pure function of
(the tokenizer's vocabulary, kind, spec), so every rank gets the same grammar.

How a kind becomes a grammar (as vLLM and SGLang do it): json -> `compile_json_schema` (compact
JSON: no free whitespace between tokens, so a model cannot spend its budget on blanks);
json_object -> the schema {"type": "object"} (xgrammar's built-in JSON grammar would also take an
array, a string or a number: "[null]" came back; OpenAI promises an object); regex -> `compile_regex`; grammar -> EBNF
(GBNF) with root rule `root`; choice -> an EBNF alternation of the quoted strings;
structural_tag -> `compile_structural_tag` on the JSON.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from minisgl.core import StructuredOutput

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
Compiled = Any  # an xgrammar.CompiledGrammar (xgrammar is imported on first use)
_ANY_OBJECT = '{"type": "object"}'  # json_object: any keys and values (strict_mode off)


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why."""


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _choices(spec: str) -> List[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choice must be a JSON list of strings: {e}") from None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) for c in choices)):
        raise GrammarError("choice must be a non-empty list of strings")
    return choices


def _json_schema(spec: str) -> str:
    """The schema text, checked to be a JSON object (xgrammar's messages for non-JSON input are
    less clear than this)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return spec


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:30:24] /path/file.cc:94: ")."""
    text = str(e).strip()
    lines = [ln for ln in (_LOG_PREFIX.sub("", ln).strip() for ln in text.splitlines()) if ln]
    return lines[0] if lines else type(e).__name__


def compile_structured(compiler: Any, structured: StructuredOutput) -> Compiled:
    """`structured` compiled by `compiler` (an xgrammar.GrammarCompiler); GrammarError why not."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            return compiler.compile_json_schema(_json_schema(spec), any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False,
                                                strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "grammar":
            return compiler.compile_grammar(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(_choices(spec)))
        if kind == "structural_tag":
            return compiler.compile_structural_tag(spec)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar reports every bad spec as some exception with a reason
        raise GrammarError(f"cannot compile the {kind} constraint: {_reason(e)}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


class TokenizerSource:
    """What xgrammar needs to know about the vocabulary: the Hugging Face tokenizer (or the
    model directory to load it from), the model's vocabulary size (the logits' width, which may
    exceed the tokenizer's) and the ids that end a request (the grammar allows them only where
    it may end)."""

    def __init__(self, tokenizer: Any = None, model_path: Optional[str] = None,
                 vocab_size: Optional[int] = None, stop_ids: Sequence[int] = ()) -> None:
        if tokenizer is None and model_path is None:
            raise ValueError("a tokenizer or a model path is needed")
        self.tokenizer, self.model_path = tokenizer, model_path
        self.vocab_size, self.stop_ids = vocab_size, tuple(stop_ids)

    def info(self) -> Any:
        import xgrammar as xgr
        tokenizer = self.tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(Path(str(self.model_path))))
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_ids) or None)


class GrammarCache:
    """Compiled grammars by (kind, spec), compiled on demand.

    `check` compiles in the caller's thread (the tokenizer's validation); `submit` returns a
    Future compiled by one worker thread, in submission order (a rank's decode loop goes on
    meanwhile). The xgrammar compiler itself (and the tokenizer it reads) is built on first use,
    so a process that never sees a constraint pays nothing.
    """

    def __init__(self, source: TokenizerSource, max_entries: int = 256) -> None:
        self.source = source
        self.max_entries = max_entries
        self._compiler: Any = None
        self._compiled: Dict[Tuple[str, str], Compiled] = {}
        # The dict is shared by the worker thread and the caller's: held only to read or
        # write it, never while compiling (a cache hit must not wait for a compilation).
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                self._compiler = xgr.GrammarCompiler(self.source.info(), max_threads=1)
            return self._compiler

    def check(self, structured: StructuredOutput) -> Compiled:
        """The compiled grammar; GrammarError why it does not compile."""
        key = (structured.kind, structured.spec)
        with self._lock:
            hit = self._compiled.get(key)
        if hit is not None:
            return hit
        compiled = compile_structured(self._get_compiler(), structured)
        with self._lock:
            if len(self._compiled) >= self.max_entries:  # oldest first: dicts keep order
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        return compiled

    def submit(self, structured: StructuredOutput) -> "Future[Compiled]":
        """A Future of `check(structured)` (already done on a cache hit)."""
        with self._lock:
            hit = self._compiled.get((structured.kind, structured.spec))
        if hit is not None:
            done: Future = Future()
            done.set_result(hit)
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.check, structured)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def make_checker(tokenizer: Any, vocab_size: Optional[int] = None
                 ) -> Callable[[StructuredOutput], Optional[str]]:
    """A function giving why a constraint does not compile for this tokenizer, or None (the
    tokenizer process's and `LLM`'s validation, before a request is sent on)."""
    cache = GrammarCache(TokenizerSource(tokenizer, vocab_size=vocab_size))

    def error(structured: StructuredOutput) -> Optional[str]:
        try:
            cache.check(structured)
        except GrammarError as e:
            return str(e)
        return None
    return error
