"""A reasoning model's constrained output: the thinking goes free, the constraint holds after it
(grammar/reasoning.py), as vLLM serves structured output with a reasoning parser. A tiny random
model whose tokenizer has `<think>` / `</think>` as special tokens (two of SmolLM2's unused
ones renamed), through the scheduler's matcher (the gate given as the tokenizer resolves it),
the tokenizer's resolution, and the chat path's marking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import StructuredOutput

START, END = 3, 4  # the renamed special tokens' ids
CHOICES = ["yes", "no"]


def _with_think_tokens(model: Path) -> Path:
    """`model`'s tokenizer with ids 3 and 4 spelled <think> and </think>."""
    names = {"<repo_name>": "<think>", "<reponame>": "</think>"}
    tok_file = model / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    for added in tok["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    vocab = tok["model"]["vocab"]
    for old, new in names.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    tok_file.write_text(json.dumps(tok))
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for entry in (config.get("added_tokens_decoder") or {}).values():
        entry["content"] = names.get(entry["content"], entry["content"])
    config["additional_special_tokens"] = [
        names.get(t, t) for t in config.get("additional_special_tokens") or []]
    config_file.write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path]) -> Path:
    return _with_think_tokens(tiny_model("qwen3"))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(model: Path, request: pytest.FixtureRequest) -> Any:
    """The tiny model in float32 on the CPU, and on CUDA (masked sampling after the decode
    graphs, the bitmask pinned)."""
    with LLM(str(model), device=request.param, dtype="float32", max_kv_tokens=2048,
             show_progress=False) as offline:
        yield offline


def _tokens(llm: Any, structured: Any = None, bias: Dict[int, float] = {},
            n: int = 12) -> List[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                            structured=structured, logit_bias=dict(bias) or None)
    return llm.generate([[100, 200, 300, 400]], params)[0].token_ids


def _choice(**gate: Any) -> StructuredOutput:
    return StructuredOutput("choice", json.dumps(CHOICES), **gate)


def test_thinking_goes_free_and_the_constraint_holds_after_it(llm: Any) -> None:
    """Inside the thinking (the template opened it) the tokens are the unconstrained ones; the
    end marker closes it and the rest is a choice; a first token may open the thinking
    (then free) or be the choice's; without a gate the choice holds from the first token."""
    tok = llm.get_tokenizer()
    free = _tokens(llm)
    assert END not in free and START not in free
    assert _tokens(llm, _choice(think_start=START, think_end=END, thinking=True)) == free
    # the end marker (pushed to the top everywhere) closes the thinking, then a choice
    closed = _tokens(llm, _choice(think_start=START, think_end=END, thinking=True), {END: 100})
    assert closed[0] == END and tok.decode(closed[1:], skip_special_tokens=True) in CHOICES
    plain = _tokens(llm, _choice())
    assert tok.decode(plain, skip_special_tokens=True) in CHOICES
    # a first token that may open the thinking: the choice's where the model does not open it
    # (START pushed down), START where it does (then free: the bias keeps it on START)
    opening = _choice(think_start=START, think_end=END)
    assert _tokens(llm, opening, {START: -100}) == plain
    assert _tokens(llm, opening, {START: 100}) == [START] * 12
    first = _tokens(llm, opening)  # as the model prefers: one of the two
    assert first[0] == START or first == plain
    # the start marker is no choice's token: without the gate the bias cannot pick it
    assert START not in _tokens(llm, _choice(), {START: 100})


def test_the_tokenizer_resolves_the_gate_from_the_prompt(model: Path) -> None:
    """think_gate: markers that are single tokens; a prompt ending in a closed (empty) thinking
    block is constrained at once, one ending inside it (or DeepSeek-R1's template) thinks; a
    format whose markers are phrases (Granite) has no gate."""
    from minisgl.grammar.reasoning import ThinkGate, think_gate
    from minisgl.tokenizer.text import load_tokenizer
    tok = load_tokenizer(model)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert think_gate(tok, "qwen3", prompt) == ThinkGate(START, END, False)
    closed = prompt + [START] + tok.encode("\n\n", add_special_tokens=False) + [END]
    assert think_gate(tok, "qwen3", closed + tok.encode("\n\n", add_special_tokens=False)) == (
        ThinkGate())
    assert think_gate(tok, "qwen3", prompt + [START, 11]) == ThinkGate(START, END, True)
    assert think_gate(tok, "deepseek-r1", prompt) == ThinkGate(START, END, True)
    assert think_gate(tok, "granite", prompt) == ThinkGate()
    assert think_gate(tok, "mistral", prompt) == ThinkGate()  # [THINK] is no token here


def test_a_chat_constraint_of_a_reasoning_model_is_gated(model: Path) -> None:
    """The chat path marks a constraint (response_format, and the calls' grammar) with the
    server's reasoning parser; the tokenizer resolves it for the prompt it built."""
    from minisgl.core import Limits
    from minisgl.message.types import TokenizeRequest
    from minisgl.server.protocol import ChatRequest, chat_job, parse_body
    from minisgl.tokenizer.text import load_tokenizer
    from minisgl.tokenizer.tokenize_worker import Tokenizer
    body = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}).encode(),
                      ChatRequest)
    assert chat_job(body, 1).params.structured.reasoning == ""
    job = chat_job(body, 1, reasoning_parser="qwen3")
    assert job.params.structured.reasoning == "qwen3"
    tok = load_tokenizer(model)
    logic = Tokenizer(tok, Limits(max_context=1000, vocab_size=len(tok), num_pages=64,
                                  page_size=16, max_prefill_tokens=1000))
    prepared = logic.prepare(TokenizeRequest(uid=1, params=job.params,
                                             messages=job.prompts[0].messages))
    assert prepared.error is None, prepared.error
    gate = prepared.params.structured
    assert (gate.think_start, gate.think_end, gate.thinking) == (START, END, False)


def test_enable_in_reasoning_constrains_from_the_first_token() -> None:
    """vLLM's --structured-outputs-config: enable_in_reasoning drops the thinking gate (the
    API's served jobs: protocol.constrained_from_the_start); a backend other than xgrammar,
    or another reasoning parser than the server's, is refused by name; vLLM's parser names
    deepseek_r1 and glm45 read as deepseek-r1's and qwen3's."""
    from minisgl.grammar.reasoning import FORMATS
    from minisgl.server.args import parse_args
    from minisgl.server.protocol import (ChatRequest, chat_job, constrained_from_the_start,
                                         parse_body)
    body = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}).encode(),
                      ChatRequest)
    job = constrained_from_the_start(chat_job(body, 1, reasoning_parser="qwen3"))
    assert job.params.structured.reasoning == "" and job.params.structured.kind == "json_object"
    config = '{"backend": "xgrammar", "enable_in_reasoning": true, "reasoning_parser": "qwen3"}'
    assert parse_args(["--reasoning-parser", "qwen3", "--structured-outputs-config",
                       config]).constrain_in_reasoning
    assert not parse_args([]).constrain_in_reasoning
    for bad, named in (('{"backend": "guidance"}', "backend 'guidance' is not served"),
                       ('{"reasoning_parser": "glm45"}', "must be the server's"),
                       ('{"enable_in_reasoning": 1}', "enable_in_reasoning must be true"),
                       ('{"guided": 1}', "guided is not supported")):
        with pytest.raises(ValueError, match=named):
            parse_args(["--structured-outputs-config", bad])
    assert FORMATS["deepseek_r1"] == FORMATS["deepseek-r1"] and FORMATS["glm45"] == FORMATS[
        "qwen3"]
    assert parse_args(["--reasoning-parser", "glm45"]).reasoning_parser == "glm45"
