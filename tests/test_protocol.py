"""Request bodies as vLLM's and OpenAI's clients send them, parsed into jobs without a server:
null where OpenAI's schema allows it, vLLM's field names for features this server has under
SGLang's, the field an error names, how a message's text parts join, and which prompts get the
tokenizer's special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from minisgl.server.generate_request import GenerateRequest, generate_job
from minisgl.server.protocol import (ApiError, ChatRequest, CompletionRequest, TokenizeBody,
                                     chat_job, completion_job, parse_body, tokenize_prompt)

CHAT: Dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**extra: Any) -> ChatRequest:
    return parse_body(json.dumps({**CHAT, **extra}).encode(), ChatRequest)


def _completion(**extra: Any) -> CompletionRequest:
    return parse_body(json.dumps({"model": "m", "prompt": "hi", **extra}).encode(),
                      CompletionRequest)


def test_null_is_the_default_where_openai_allows_it() -> None:
    job = chat_job(_chat(n=None, stream=None, max_tokens=2), 4)
    assert (job.n, job.stream, job.include_usage) == (1, False, False)
    streamed = chat_job(_chat(stream=True, stream_options={"include_usage": None,
                                                           "continuous_usage_stats": None}), 4)
    assert (streamed.stream, streamed.include_usage, streamed.continuous_usage) == (
        True, False, False)
    assert completion_job(_completion(echo=None, n=None), 4).echo is False


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    """vLLM's include_stop_str_in_output is SGLang's no_stop_trim."""
    assert chat_job(_chat(stop=["!"], include_stop_str_in_output=True), 4).no_stop_trim
    assert completion_job(_completion(include_stop_str_in_output=True), 4).no_stop_trim
    assert not chat_job(_chat(stop=["!"]), 4).no_stop_trim


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -3, 2 ** 40])
def test_a_max_tokens_error_names_the_field_sent(field: str, value: int) -> None:
    with pytest.raises(ApiError) as e:
        chat_job(_chat(**{field: value}), 4)
    assert e.value.status == 400 and e.value.param == field
    assert e.value.message.startswith(field + " ") and str(value) in e.value.message


def test_text_parts_join_with_newlines() -> None:
    """As vLLM: ["Hello", "World"] is "Hello\\nWorld", not "HelloWorld"."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    job = chat_job(_chat(messages=[{"role": "user", "content": parts}]), 4)
    assert job.prompts[0].messages == [{"role": "user", "content": "Hello\nWorld"}]


def test_special_tokens_go_to_text_prompts_not_to_templated_chats() -> None:
    """vLLM's defaults of add_special_tokens: completions, /tokenize of a prompt and SGLang's
    /generate text add the tokenizer's special tokens (BOS); a chat does not (its template
    writes them), unless the request asks; token ids are taken as they are."""
    assert completion_job(_completion(), 4).prompts[0].add_special_tokens
    assert not completion_job(_completion(add_special_tokens=False), 4).prompts[0]\
        .add_special_tokens
    assert not chat_job(_chat(), 4).prompts[0].add_special_tokens
    assert chat_job(_chat(add_special_tokens=True), 4).prompts[0].add_special_tokens
    assert generate_job(GenerateRequest(text="hi")).prompts[0].add_special_tokens
    assert not generate_job(GenerateRequest(input_ids=[5])).prompts[0].add_special_tokens
    assert tokenize_prompt(TokenizeBody(prompt="hi")).add_special_tokens
    assert not tokenize_prompt(TokenizeBody(prompt="hi", add_special_tokens=False))\
        .add_special_tokens
    assert not tokenize_prompt(TokenizeBody(messages=CHAT["messages"])).add_special_tokens


def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it(
        default_model_dir: Path) -> None:
    """OpenAI's reasoning_effort (Chat Completions; the Responses API's reasoning.effort)
    becomes the template's `reasoning_effort` and `enable_thinking` (false for "none"), the
    request's own chat_template_kwargs winning; a value not OpenAI's, or a summary not one of
    OpenAI's, is a 400 naming the field; a template that reads them renders them."""
    from transformers import AutoTokenizer
    from minisgl.server.responses_api import ResponsesRequest, responses_job
    from minisgl.tokenizer.chat_template import chat_prompt_ids
    kwargs = chat_job(_chat(reasoning_effort="low"), 4).prompts[0].template.kwargs
    assert kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert chat_job(_chat(reasoning_effort="none", chat_template_kwargs={"x": 1}), 4).prompts[
        0].template.kwargs == {"reasoning_effort": "none", "enable_thinking": False, "x": 1}
    assert chat_job(_chat(reasoning_effort="high", chat_template_kwargs={
        "enable_thinking": False}), 4).prompts[0].template.kwargs["enable_thinking"] is False
    assert chat_job(_chat(), 4).prompts[0].template.kwargs is None
    with pytest.raises(ApiError) as e:
        chat_job(_chat(reasoning_effort="extreme"), 4)
    assert e.value.status == 400 and e.value.param == "reasoning_effort"

    messages = [{"role": "user", "content": "hi"}]
    respond = lambda reasoning: responses_job(  # noqa: E731
        ResponsesRequest.model_validate({"input": "hi", "reasoning": reasoning}), messages, 4)
    assert respond({"effort": "medium"}).prompts[0].template.kwargs["reasoning_effort"] == (
        "medium")
    assert respond({"effort": "low", "summary": "auto"}).prompts[0].template.kwargs[
        "reasoning_effort"] == "low"  # a summary is accepted (reasoning items carry no summary)
    for bad in ({"summary": "long"}, {"effort": "extreme"}, {"effort": 3}):
        with pytest.raises(ApiError) as e:
            respond(bad)
        assert e.value.status == 400 and e.value.param == "reasoning", bad

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}[{{ reasoning_effort }}]")
    ids = chat_prompt_ids(tokenizer, messages, chat_template=template, **kwargs)
    assert tokenizer.decode(ids) == "hi<think>[low]"


def test_assistant_thinking_reaches_the_chat_template(default_model_dir: Path) -> None:
    """An assistant message's reasoning_content (or vLLM's newer `reasoning`) goes to the
    template as reasoning_content, which templates such as Qwen3's render for the turns
    after the last user message; on another role it is a 400 naming the field."""
    from transformers import AutoTokenizer

    from minisgl.tokenizer.chat_template import chat_prompt_ids
    template = ("{% for m in messages %}{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    for field in ("reasoning_content", "reasoning"):
        job = chat_job(_chat(messages=[{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "yo",
                                        field: "greet back"}]), 4)
        messages = job.prompts[0].messages
        assert messages[1] == {"role": "assistant", "content": "yo",
                               "reasoning_content": "greet back"}
        ids = chat_prompt_ids(tokenizer, messages, chat_template=template)
        assert tokenizer.decode(ids) == "hi|<think>greet back</think>yo|"
    with pytest.raises(ApiError) as e:
        chat_job(_chat(messages=[{"role": "user", "content": "hi", "reasoning": "x"}]), 4)
    assert e.value.status == 400 and e.value.param == "messages.0.reasoning"


def test_content_reaches_a_template_in_the_form_it_reads(default_model_dir: Path) -> None:
    """--chat-template-content-format (vLLM's): auto gives a template that loops over a
    message's content (multimodal models' templates) one text part, where a string would be
    looped over character by character into nothing, and a template that prints the content
    the text; string and openai force either (the server's setting, the offline LLM.chat's
    keyword; a bad value is refused naming it)."""
    from transformers import AutoTokenizer

    from minisgl.server.args import parse_args
    from minisgl.tokenizer.chat_template import chat_prompt_ids, detected_content_format
    parts = ("{% for m in messages %}{% set content = m['content'] %}{% for p in content "
             "| selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}|{% endfor %}")
    text = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    assert detected_content_format(parts) == "openai"
    assert detected_content_format(text) == "string"
    assert detected_content_format("{% for m in messages %}") == "string"  # fails at rendering
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    messages = chat_job(_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "yo"}]), 4).prompts[0].messages

    def rendered(template: str, form: str) -> str:
        return str(tokenizer.decode(chat_prompt_ids(tokenizer, messages, False, form,
                                                    chat_template=template)))
    assert rendered(parts, "auto") == rendered(parts, "openai") == "hi\nthere|yo|"
    assert rendered(parts, "string") == "||"  # what a string-only server would send
    assert rendered(text, "auto") == rendered(text, "string") == "hi\nthere|yo|"
    assert parse_args(["--chat-template-content-format", "openai"]
                      ).chat_template_content_format == "openai"
    with pytest.raises(SystemExit):
        parse_args(["--chat-template-content-format", "parts"])


def test_default_chat_template_kwargs_under_the_requests_own(default_model_dir: Path) -> None:
    """--default-chat-template-kwargs (vLLM's): every chat prompt's template gets them, a
    request's own chat_template_kwargs and reasoning_effort win; not a JSON object: refused
    at start-up naming it."""
    from minisgl.core import Limits
    from minisgl.message.types import TextRequest
    from minisgl.server.args import parse_args
    from minisgl.tokenizer.text import load_tokenizer
    from minisgl.tokenizer.tokenize_worker import Tokenizer
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "[{{ enable_thinking }} {{ reasoning_effort }}]")
    tok = load_tokenizer(default_model_dir, template)
    logic = Tokenizer(tok, Limits(max_context=1000, vocab_size=len(tok), num_pages=64,
                                  page_size=16, max_prefill_tokens=1000),
                      {"enable_thinking": False, "reasoning_effort": "low"})

    def rendered(**fields: Any) -> str:
        prompt = chat_job(_chat(**fields), 1).prompts[0]
        kwargs = prompt.template.kwargs
        reply = logic.answer(TextRequest(1, messages=prompt.messages,
                                         template_kwargs_json=json.dumps(kwargs) if kwargs
                                         else None))
        assert reply.error is None
        return str(tok.decode(reply.token_ids))

    assert rendered().endswith("[False low]")
    assert rendered(chat_template_kwargs={"enable_thinking": True}).endswith("[True low]")
    assert rendered(reasoning_effort="high").endswith("[True high]")
    with pytest.raises(ValueError, match="default_chat_template_kwargs must be a JSON object"):
        parse_args(["--default-chat-template-kwargs", "[1]"])
