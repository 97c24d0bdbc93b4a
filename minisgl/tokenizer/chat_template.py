"""Conversations through a tokenizer's chat template, one way for the tokenizer process and the
offline `LLM.chat`: the messages put in the shape templates take, and the prompt's ids."""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any, Dict, List

_ID_CHARS = string.ascii_letters + string.digits


def chat_prompt_ids(tokenizer: Any, messages: List[Dict[str, Any]],
                    add_special_tokens: bool = False, **template: Any) -> List[int]:
    """The prompt ids of `messages` through the tokenizer's chat template (`template`: its
    keywords, `chat_template` among them to replace the tokenizer's own). The templated text
    carries its special tokens; `add_special_tokens` encodes it with the tokenizer's own too
    (vLLM's request field). ValueError for an assistant's call `arguments` that are not JSON;
    the template's own errors (jinja2's) pass through."""
    chat_template = template.get("chat_template") or getattr(tokenizer, "chat_template", None)
    messages = template_messages(messages, takes_mistral_call_ids(chat_template))
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
        return list(tokenizer.encode(text, add_special_tokens=True))
    out = tokenizer.apply_chat_template(messages, tokenize=True, **template)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def template_messages(messages: List[Dict[str, Any]], mistral_ids: bool = False
                      ) -> List[Dict[str, Any]]:
    """The messages as chat templates take them: an assistant's tool calls with their
    `arguments` as objects (OpenAI sends JSON text; templates write `arguments | tojson` or
    iterate over them; vLLM hands them over so, and empty arguments as {}); with `mistral_ids`
    (Mistral's templates: `takes_mistral_call_ids`), every call id (`tool_calls[].id`,
    `tool_call_id`) as `as_mistral_call_id` gives it. The messages given are not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        if mistral_ids:
            m = _mistral_ids(m)
        out.append(m)
    return out


def _with_object_arguments(call: Dict[str, Any]) -> Dict[str, Any]:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        arguments = json.loads(arguments)
    elif not arguments:
        arguments = {}
    return {**call, "function": {**call["function"], "arguments": arguments}}


def takes_mistral_call_ids(chat_template: Any) -> bool:
    """Whether a chat template is Mistral's (it writes `[TOOL_CALLS]`), which refuses any call
    id but 9 letters and digits."""
    return isinstance(chat_template, str) and "[TOOL_CALLS]" in chat_template


def as_mistral_call_id(call_id: str) -> str:
    """`call_id` as Mistral's chat templates accept it: itself when 9 letters and digits, else
    9 letters and digits derived from all of it, so that a call and the tool message answering
    it still match and two ids stay apart (OpenAI's `call_...` ids, Anthropic's `toolu_...`,
    ids from another server). vLLM keeps the last 9 characters instead, which may share."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(9):
        n, d = divmod(n, len(_ID_CHARS))
        digits.append(_ID_CHARS[d])
    return "".join(digits)


def _mistral_ids(m: Dict[str, Any]) -> Dict[str, Any]:
    """Message `m` with its call ids as Mistral's templates take them."""
    m = dict(m)
    if isinstance(m.get("tool_call_id"), str):
        m["tool_call_id"] = as_mistral_call_id(m["tool_call_id"])
    if isinstance(m.get("tool_calls"), list):
        m["tool_calls"] = [{**c, "id": as_mistral_call_id(c["id"])}
                           if isinstance(c, dict) and isinstance(c.get("id"), str) else c
                           for c in m["tool_calls"]]
    return m
