"""OpenAI's Responses API in process: input items (messages, function calls and their outputs,
reasoning) as chat messages; flat function tools, tool_choice and text.format as chat's; the
reply's output items (reasoning, message, function_call) plain and streamed, every event and
the response checked against the `openai` SDK's own types, the stream folding into the plain
response; the stored conversation a later request continues; 400s naming this API's fields.
(The served endpoint, end to end: tests/test_openai_conformance.py.)"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from formatter_helpers import chunks_of, plain_and_streamed

from minisgl.message.types import ReplyChunk, TokenLogprobText
from minisgl.server.protocol import ApiError
from minisgl.server.responses import Choice
from minisgl.server.responses_api import (ResponsesRequest, ResponseStore, response_messages,
                                          responses_job)
from minisgl.server.responses_output import ResponsesFormatter

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})


def _error(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_input_items_become_the_chat_conversation() -> None:
    """Messages keep their roles (text parts joined); a function_call joins the assistant
    message before it, its output is a tool message; earlier reasoning items are dropped;
    instructions come first."""
    items = [{"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                  "text": "Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather",
              "arguments": '{"city": "Lyon"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "developer", "content": "Be brief."}]
    got = response_messages(_request(input=items, instructions="You help."), ResponseStore())
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for k, city in ((1, "Paris"), (2, "Lyon"))]
    assert got == [{"role": "system", "content": "You help."},
                   {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                   {"role": "developer", "content": "Be brief."}]
    # a call with no assistant message before it starts one
    only = response_messages(_request(input=[items[3]]), ResponseStore())
    assert only == [{"role": "assistant", "content": "", "tool_calls": calls[:1]}]
    for bad, param in (([{"type": "web_search_call"}], "input.0.type"),
                       ([{"type": "function_call", "name": "f", "arguments": "{}"}],
                        "input.0.call_id"),
                       ([{"type": "function_call_output", "call_id": "c", "output": [
                           {"type": "input_image", "image_url": "x"}]}], "input.0.output"),
                       ([{"type": "message", "content": "x"}], "input.0.role")):
        assert _error(response_messages, _request(input=bad), ResponseStore()).param == param


def test_tools_tool_choice_and_text_format_reach_the_chat_path() -> None:
    """Flat function tools are chat's tools (a named tool_choice constrains the output to that
    call); text.format json_schema / json_object is chat's structured output; reasoning
    summaries are accepted (none is written); the rest is a 400 naming this API's field."""
    messages = [{"role": "user", "content": "hi"}]

    def job(**body: Any) -> Any:
        return responses_job(_request(**body), messages, 4)

    j = job(tools=[WEATHER])
    assert j.tools is not None and j.tools.parsed and j.params.structured is None
    forced = job(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert forced.params.structured is not None and forced.structured_param == "tools"
    assert job(tools=[WEATHER], tool_choice="none").tools is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s = job(text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                             "strict": True}})
    assert s.params.structured is not None and json.loads(s.params.structured.spec) == schema
    assert job(text={"format": {"type": "json_object"}}).params.structured is not None
    assert job(text={"format": {"type": "text"}}).params.structured is None
    assert job(reasoning={"effort": "low", "summary": "auto"}).prompts[0].template.kwargs[
        "reasoning_effort"] == "low"
    cases = [({"tools": [{"type": "web_search"}]}, "tools.0.type"),
             ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
              "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
             ({"text": {"format": {"type": "grammar"}}}, "text.format"),
             ({"text": {"verbosity": "low"}}, "text.verbosity"),
             ({"reasoning": {"summary": "long"}}, "reasoning"),
             ({"max_output_tokens": 0}, "max_output_tokens")]
    for body, param in cases:
        with pytest.raises(ApiError) as e:
            job(**body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


def _formatted(chunks: List[str], reasoning: Any = None, finish: str = "stop", **body: Any
               ) -> Tuple[Dict[str, Any], List[Dict[str, Any]], ResponseStore]:
    """The plain response and the stream's events of one output given as `chunks` (text
    pieces, the last ending it), formatted in process."""
    request = _request(**body)
    store = ResponseStore()
    messages = response_messages(request, store)

    def formatter() -> ResponsesFormatter:
        return ResponsesFormatter("m", responses_job(request, messages, 1), request, messages,
                                  store, reasoning, "hermes")
    response, lines = plain_and_streamed(formatter, chunks_of(chunks, finish))
    events = []
    for line in lines:
        name, data = line.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the SDK's own event types
        events.append(event)
    Response.model_validate(response)
    return response, events, store


def _fold(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The output a client assembles from the events (added items, their deltas)."""
    output: List[Dict[str, Any]] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            output.append(json.loads(json.dumps(e["item"])))
        elif e["type"] == "response.content_part.added":
            output[e["output_index"]]["content"].append(dict(e["part"]))
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            output[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            output[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            done = {k: e["item"][k] for k in ("status", "encrypted_content") if k in e["item"]}
            assert {**output[e["output_index"]], **done} == e["item"]
            output[e["output_index"]] = e["item"]
    return output


def test_reasoning_text_and_calls_are_output_items_streamed_as_the_plain_response() -> None:
    """With a reasoning parser and tools: a reasoning item (the thinking as reasoning_text), a
    message, then a function_call per call, each opened, filled and closed in turn; sequence
    numbers count from 0; the stream folds into the plain response's output; the stored turn
    carries the calls, so that a function_call_output continues the conversation."""
    chunks = ["<think>", "Paris, ", "surely.</think>", "Let me", " check.\n<tool_call>\n",
              '{"name": "get_weather", "arguments": ', '{"city": "Paris"}}\n</tool_call>', ""]
    response, events, store = _formatted(chunks, "qwen3", tools=[WEATHER])
    output = response["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Paris, surely."}]
    assert output[1]["content"][0]["text"].strip() == "Let me check."
    call = output[2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call") and call["status"] == "completed"
    usage = response["usage"]
    assert response["status"] == "completed" and usage["output_tokens"] == len(chunks)
    # "Paris, " and "surely.</think>" (a chunk, not the "<think>" before any reasoning text)
    assert usage["output_tokens_details"]["reasoning_tokens"] == 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")}  # noqa
                           for i in items]
    assert strip(_fold(events)) == strip(output)
    assert strip(events[-1]["response"]["output"]) == strip(output)

    assert store.stored(response["id"]).response == response  # GET /v1/responses/{id}
    turn = store.get(response["id"])[-1]
    assert turn["role"] == "assistant" and turn["content"].strip() == "Let me check."
    assert turn["tool_calls"][0]["id"] == call["call_id"]
    follow = _request(previous_response_id=response["id"], input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    messages = response_messages(follow, store)
    assert messages[-2:] == [turn, {"role": "tool", "tool_call_id": call["call_id"],
                                    "content": "sunny"}]


def test_reasoning_round_trips_through_encrypted_content() -> None:
    """include ["reasoning.encrypted_content"] (what Codex-style clients that keep no state
    send): each reasoning item, plain and streamed, carries its thinking as encrypted_content;
    sent back (without its content, as such clients do) it becomes the next assistant turn's
    reasoning_content, before a message or a call alike. Content wins over the blob, another
    provider's blob is dropped, and without include there is none."""
    chunks = ["<think>", "Paris, ", "surely.</think>", "It is Paris.", ""]
    response, events, store = _formatted(chunks, "qwen3", store=False,
                                         include=["reasoning.encrypted_content"])
    reasoning = response["output"][0]
    blob = reasoning["encrypted_content"]
    assert isinstance(blob, str) and "Paris" not in blob  # opaque to the client
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["encrypted_content"] == blob and len(store._items) == 0  # store false
    sent_back = {"type": "reasoning", "id": reasoning["id"], "summary": [],
                 "encrypted_content": blob}
    user = {"role": "user", "content": "Capital of France?"}
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "It is Paris."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather",
            "arguments": "{}"}
    turn = response_messages(_request(input=[user, sent_back, answer]), ResponseStore())
    assert turn[1] == {"role": "assistant", "content": "It is Paris.",
                       "reasoning_content": "Paris, surely."}
    called = response_messages(_request(input=[user, sent_back, call]), ResponseStore())
    assert called[1]["reasoning_content"] == "Paris, surely." and called[1]["tool_calls"]
    both = {**sent_back, "content": [{"type": "reasoning_text", "text": "shown"}]}
    assert response_messages(_request(input=[user, both, answer]), ResponseStore())[1][
        "reasoning_content"] == "shown"
    foreign = {**sent_back, "encrypted_content": "gAAAAABoPaqueOtherProvider=="}
    assert "reasoning_content" not in response_messages(
        _request(input=[user, foreign, answer]), ResponseStore())[1]
    bad = {**sent_back, "content": [{"type": "output_text", "text": "x"}]}
    assert _error(response_messages, _request(input=[user, bad]), ResponseStore()).param == (
        "input.1.content")
    plain, _, kept = _formatted(chunks, "qwen3")
    assert plain["output"][0]["encrypted_content"] is None
    # a stored turn keeps its thinking the same way, for the chat template to keep or drop
    assert kept.get(plain["id"])[-1]["reasoning_content"] == "Paris, surely."


def test_plain_text_empty_and_cut_off_outputs() -> None:
    """Without a parser the text is one message; an empty output is one empty message; an
    output cut off by max_output_tokens is incomplete, its message too."""
    response, events, _ = _formatted(["Hello", " world", ""])
    assert [i["type"] for i in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == "Hello world"
    response, events, _ = _formatted([""])
    assert response["output"][0]["content"] == [
        {"type": "output_text", "text": "", "annotations": []}]
    assert [e["type"] for e in events].count("response.output_item.added") == 1
    response, events, _ = _formatted(["Hel", "lo"], finish="length")
    assert response["status"] == "incomplete" and response["output"][0]["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


def test_a_failed_stream_ends_with_an_error_event() -> None:
    request = _request()
    fmt = ResponsesFormatter("m", responses_job(request, [{"role": "user", "content": "hi"}],
                                                1), request, [], ResponseStore())
    lines = list(fmt.error_events(ApiError(503, "down")))
    event = json.loads(lines[0].split("\n")[1].removeprefix("data: "))
    EVENTS.validate_python(event)
    assert event["type"] == "error" and event["message"] == "down"


def test_logprobs_go_with_the_message_text() -> None:
    """include ["message.output_text.logprobs"] with top_logprobs: each message token's entry
    (chat's shape, the SDK's Logprob) on its delta and in the output text part, in order;
    the reasoning's tokens give none; plain and streamed agree; without include, none."""
    texts = ["<think>", "hm", "</think>", "Par", "is", ""]
    replies = [ReplyChunk(0, t, [k], prompt_tokens=7, completion_tokens=k + 1,
                          finish_reason="stop" if k == len(texts) - 1 else None,
                          logprobs=[TokenLogprobText(t or "<eos>", -0.5 * k, ("a", "b"),
                                                     (-1.0, -2.0))])
               for k, t in enumerate(texts)]
    request = _request(include=["message.output_text.logprobs"], top_logprobs=2)
    messages = response_messages(request, ResponseStore())

    def formatter() -> ResponsesFormatter:
        return ResponsesFormatter("m", responses_job(request, messages, 1), request, messages,
                                  ResponseStore(), "qwen3", "hermes")
    response, lines = plain_and_streamed(formatter, replies)
    Response.model_validate(response)
    part = response["output"][1]["content"][0]
    assert part["text"] == "Paris"
    # the thinking's tokens, its tags included, give none
    assert [e["token"] for e in part["logprobs"]] == ["Par", "is"]
    assert part["logprobs"][0] == {"token": "Par", "logprob": -1.5, "bytes": list(b"Par"),
                                   "top_logprobs": [
                                       {"token": "a", "logprob": -1.0, "bytes": [97]},
                                       {"token": "b", "logprob": -2.0, "bytes": [98]}]}
    events = [json.loads(line.split("\n")[1].removeprefix("data: ")) for line in lines]
    streamed = [e for d in events if d["type"] == "response.output_text.delta"
                for e in d["logprobs"]]
    assert streamed == part["logprobs"]
    plain = _request()
    assert "logprobs" not in ResponsesFormatter(
        "m", responses_job(plain, messages, 1), plain, messages, ResponseStore()).full(
        [Choice(text=["x"], text_tokens=[1], finish_reason="stop")])["output"][0]["content"][0]
    with pytest.raises(ApiError) as e:
        responses_job(_request(include=["file_search_call.results"]), messages, 1)
    assert e.value.param == "include"
    with pytest.raises(ApiError) as e:
        responses_job(_request(top_logprobs=2), messages, 1)
    assert e.value.param == "top_logprobs" and "include" in e.value.message


def test_input_items_listed_with_ids_a_page_at_a_time() -> None:
    """GET /v1/responses/{id}/input_items: the request's input as the SDK's item types
    (ids kept or given, messages' content as parts), newest first unless order asc; limit
    and after page through them; bad parameters are 400s naming them."""
    from openai.types.responses import ResponseItem
    from minisgl.server.responses_api import input_items, items_page
    items = input_items(_request(input=[
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "id": "msg_own", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]))
    for item in items:
        TypeAdapter(ResponseItem).validate_python(item)
    assert [i["type"] for i in items] == ["message", "reasoning", "message", "function_call",
                                          "function_call_output"]
    assert items[0]["content"] == [{"type": "input_text", "text": "Weather?"}]
    assert items[2]["id"] == "msg_own" and items[2]["content"][0]["type"] == "output_text"
    assert len({i["id"] for i in items}) == 5
    assert input_items(_request(input="hi"))[0]["content"] == [
        {"type": "input_text", "text": "hi"}]
    first = items_page(items, 2)
    assert [i["id"] for i in first["data"]] == [items[4]["id"], items[3]["id"]]
    assert first["has_more"] and first["last_id"] == items[3]["id"]
    rest = items_page(items, 20, "desc", first["last_id"])
    assert rest["data"] == items[2::-1] and not rest["has_more"]
    assert items_page(items, "3", "asc")["data"] == items[:3]
    for args, param in (((items, 0), "limit"), ((items, 101), "limit"),
                        ((items, "x"), "limit"), ((items, 20, "up"), "order"),
                        ((items, 20, "asc", "msg_none"), "after")):
        assert _error(items_page, *args).param == param


def test_the_store_keeps_the_newest_and_deletes() -> None:
    """The newest `capacity` responses are kept (the oldest dropped first); a deleted one is
    gone for GET and for previous_response_id alike, each a 404 (naming the field where a
    request gave it)."""
    store = ResponseStore(2)
    for rid in "abc":
        store.put(rid, [{"role": "user", "content": rid}], {"id": rid})
    assert store.stored("c").response == {"id": "c"} and store.get("b")[0]["content"] == "b"
    store.delete("b")
    for fn, param in ((store.stored, None), (store.get, "previous_response_id"),
                      (store.delete, None)):
        for rid in "ab":
            with pytest.raises(ApiError) as e:
                fn(rid)
            assert e.value.status == 404 and e.value.param == param


def test_background_responses_are_stored_as_they_start_and_end() -> None:
    """background: true needs store and no stream; its response is stored in progress (which
    previous_response_id may not continue yet), then cancelled or failed with OpenAI's error
    codes, each a valid SDK Response."""
    messages = [{"role": "user", "content": "hi"}]
    for body in ({"background": True, "stream": True}, {"background": True, "store": False}):
        with pytest.raises(ApiError) as e:
            responses_job(_request(**body), messages, 1)
        assert e.value.status == 400 and e.value.param == "background"
    request = _request(background=True)
    store = ResponseStore()
    fmt = ResponsesFormatter("m", responses_job(request, messages, 1), request, messages, store)
    started = fmt.pending()
    assert started["status"] == "in_progress" and started["background"] is True
    assert store.stored(fmt.id).response == started
    with pytest.raises(ApiError) as e:
        store.get(fmt.id)
    assert e.value.status == 400 and "in progress" in e.value.message
    for status, error, code in (("cancelled", None, None),
                                ("failed", ApiError(503, "down"), "server_error"),
                                ("failed", ApiError(429, "busy"), "rate_limit_exceeded"),
                                ("failed", ApiError(400, "too long"), "invalid_prompt")):
        fmt.ended(status, error)
        ended = store.stored(fmt.id).response
        Response.model_validate(ended)
        assert ended["status"] == status
        assert ended["error"] == (None if error is None else {"code": code,
                                                              "message": error.message})
    assert store.get(fmt.id) == messages  # ended: a later request may continue it


def test_a_conversation_comes_before_the_input_and_records_each_turn() -> None:
    """The Conversations API's store: items checked as a Responses input (400s naming the
    item), kept with ids; a request naming the conversation (an id, or {"id": ...}) sees its
    items after the instructions and before its input; the finished response names it and
    its input and output items are appended (the SDK's ConversationItem types), once; a
    conversation deleted while a response ran records nothing; previous_response_id and
    conversation together are a 400; an unknown conversation a 404."""
    from openai.types.conversations import ConversationItem
    from minisgl.server.conversations import (MAX_ADDED, ConversationLink, ConversationStore,
                                              checked_items, conversation_id)
    convs = ConversationStore()
    first = checked_items([{"role": "user", "content": "Hi, I am Ann."},
                           {"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "Hello Ann."}]}])
    conv = convs.create(first, {"topic": "names"})
    assert conv.card() == {"id": conv.id, "object": "conversation",
                           "created_at": conv.created_at, "metadata": {"topic": "names"}}
    for value in (conv.id, {"id": conv.id}):
        assert conversation_id(value) == conv.id
    for bad in ({"id": 1}, {"id": conv.id, "x": 1}, "", 5):
        assert _error(conversation_id, bad).param == "conversation"
    assert _error(checked_items, [{"type": "web_search_call"}]).param == "items.0.type"
    assert _error(checked_items, [{"role": "user", "content": "x"}] * (MAX_ADDED + 1)
                  ).param == "items"

    request = _request(input="What is my name?", instructions="Be brief.", conversation=conv.id)
    store = ResponseStore()
    messages = response_messages(request, store, convs.messages(conv.id))
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi, I am Ann."},
                        {"role": "assistant", "content": "Hello Ann."},
                        {"role": "user", "content": "What is my name?"}]
    fmt = ResponsesFormatter("m", responses_job(request, messages, 1), request, messages, store,
                             None, "hermes", ConversationLink(convs, conv.id))
    whole = Choice()
    for reply in chunks_of(["You are ", "Ann."], "stop"):
        whole.add(reply)
    response = fmt.full([whole])
    Response.model_validate(response)
    assert response["conversation"] == {"id": conv.id}
    items = convs.get(conv.id).items
    assert [(i["type"], i["role"]) for i in items] == [("message", "user"),
                                                       ("message", "assistant")] * 2
    assert items[2]["content"] == [{"type": "input_text", "text": "What is my name?"}]
    assert items[3]["content"][0]["text"] == "You are Ann." and items[3] == response["output"][0]
    for item in items:
        TypeAdapter(ConversationItem).validate_python(item)
    assert len({i["id"] for i in items}) == 4 and convs.item(conv.id, items[3]["id"]) == items[3]
    assert convs.messages(conv.id)[-1] == {"role": "assistant", "content": "You are Ann."}

    convs.delete(conv.id)
    convs.record(conv.id, items)  # deleted while a response ran: nothing to record
    for fn, args in ((convs.get, (conv.id,)), (convs.messages, (conv.id,)),
                     (convs.item, (conv.id, items[0]["id"]))):
        with pytest.raises(ApiError) as e:
            fn(*args)  # type: ignore[operator]
        assert e.value.status == 404
    both = _request(conversation="conv_x", previous_response_id="resp_x")
    assert _error(response_messages, both, store).param == "conversation"


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(
        default_model_dir: Any) -> None:
    """truncation "auto": a conversation longer than the context loses its oldest whole
    turns (a user message and what answered it), the fewest that make it fit, the system
    message kept and the last turn never dropped; "disabled" (and unset) keeps the 400; where
    the last turn alone does not fit, the 400 stands; a bad value is a 400 naming the field."""
    from minisgl.core import Limits
    from minisgl.message.types import TokenizeRequest
    from minisgl.tokenizer.text import load_tokenizer
    from minisgl.tokenizer.tokenize_worker import Tokenizer
    from minisgl.tokenizer.truncation import fewest_dropped, split_turns
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = load_tokenizer(default_model_dir, template)
    logic = Tokenizer(tok, Limits(max_context=160, vocab_size=len(tok), num_pages=64,
                                  page_size=16, max_prefill_tokens=1000))
    turns = [[{"role": "user", "content": f"Question {i}: " + "word " * 20},
              {"role": "assistant", "content": "", "tool_calls": [{
                  "id": f"c{i}", "type": "function",
                  "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": f"c{i}", "content": "result " * 5},
              {"role": "assistant", "content": f"Answer {i}."}] for i in range(4)]
    system = {"role": "system", "content": "Be brief."}
    messages = [system, *(m for t in turns for m in t), {"role": "user", "content": "Last?"}]
    head, split = split_turns(messages)
    assert head == [system] and len(split) == 5 and split[1] == turns[1]
    assert fewest_dropped(messages, lambda ms: len(ms) <= 6) == [system, *turns[3],
                                                                {"role": "user",
                                                                 "content": "Last?"}]
    assert fewest_dropped(messages, lambda ms: False) is None

    def prepared(body: Dict[str, Any], convo: List[Dict[str, Any]]) -> Any:
        job = responses_job(_request(**body), convo, 1)
        p = job.prompts[0]
        return logic.prepare(TokenizeRequest(1, job.params, messages=p.messages,
                                             drop_oldest=p.drop_oldest))
    assert "no room for output in the context length of 160" in prepared({}, messages).error
    assert prepared({"truncation": "disabled"}, messages).error is not None
    cut = prepared({"truncation": "auto", "max_output_tokens": 8}, messages)
    assert cut.error is None and len(cut.input_ids) + 8 <= 160
    text = tok.decode(cut.input_ids)
    assert text.startswith("system: Be brief.") and "Last?" in text
    assert "Question 0" not in text and "Question 3" in text  # whole turns, oldest first
    assert text.count("tool:") == text.count("Question")  # no result without its call
    huge = [system, {"role": "user", "content": "word " * 400}]
    assert "no room for output" in prepared({"truncation": "auto"}, huge).error
    assert _error(responses_job, _request(truncation="middle"), messages, 1).param == \
        "truncation"
