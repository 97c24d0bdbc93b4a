"""Conversations through a tokenizer's chat template, one way for the tokenizer process and the
offline `LLM.chat`: the messages put in the shape templates take, and the prompt's ids."""

from __future__ import annotations

import functools
import hashlib
import json
import string
from typing import Any, Dict, List

_ID_CHARS = string.ascii_letters + string.digits
# How a message's content reaches the template (vLLM's --chat-template-content-format): text
# ("string"), a list of parts ("openai": [{"type": "text", "text": ...}], which templates
# written for multimodal models iterate over), or whichever the template reads ("auto").
CONTENT_FORMATS = ("auto", "string", "openai")


def chat_prompt_ids(tokenizer: Any, messages: List[Dict[str, Any]],
                    add_special_tokens: bool = False, content_format: str = "auto",
                    **template: Any) -> List[int]:
    """The prompt ids of `messages` through the tokenizer's chat template (`template`: its
    keywords, `chat_template` among them to replace the tokenizer's own), each message's
    content in `content_format` (CONTENT_FORMATS). The templated text
    carries its special tokens; `add_special_tokens` encodes it with the tokenizer's own too
    (vLLM's request field). ValueError for an assistant's call `arguments` that are not JSON;
    the template's own errors (jinja2's) pass through."""
    chat_template = template.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if content_format == "auto":
        content_format = (detected_content_format(chat_template)
                          if isinstance(chat_template, str) else "string")
    messages = template_messages(messages, takes_mistral_call_ids(chat_template),
                                 content_format == "openai")
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
        return list(tokenizer.encode(text, add_special_tokens=True))
    out = tokenizer.apply_chat_template(messages, tokenize=True, **template)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def template_messages(messages: List[Dict[str, Any]], mistral_ids: bool = False,
                      parts: bool = False) -> List[Dict[str, Any]]:
    """The messages as chat templates take them: an assistant's tool calls with their
    `arguments` as objects (OpenAI sends JSON text; templates write `arguments | tojson` or
    iterate over them; vLLM hands them over so, and empty arguments as {}); with `mistral_ids`
    (Mistral's templates: `takes_mistral_call_ids`), every call id (`tool_calls[].id`,
    `tool_call_id`) as `as_mistral_call_id` gives it; with `parts`, text content as one text
    part ([{"type": "text", "text": ...}]). The messages given are not changed."""
    out = []
    for m in messages:
        if parts and isinstance(m.get("content"), str):
            m = {**m, "content": [{"type": "text", "text": m["content"]}]}
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


@functools.lru_cache(maxsize=16)
def detected_content_format(chat_template: str) -> str:
    """"openai" where the template loops over a message's content (`message['content']`,
    `message.content`, filtered, or a variable set to it), as templates of multimodal models
    do, which would otherwise loop over a string's characters; else "string". vLLM's auto
    detection reads templates the same way."""
    import jinja2
    from jinja2 import nodes
    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"  # the template's error comes when it renders

    def unfiltered(node: Any) -> Any:
        while isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        return node

    def content(node: Any) -> bool:
        node = unfiltered(node)
        return ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                 and node.arg.value == "content")
                or (isinstance(node, nodes.Getattr) and node.attr == "content"))
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and content(a.node)}
    for loop in tree.find_all(nodes.For):
        looped = unfiltered(loop.iter)
        if content(looped) or (isinstance(looped, nodes.Name) and looped.name in aliases):
            return "openai"
    return "string"
