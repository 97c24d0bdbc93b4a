"""Structured output (xgrammar): JSON schemas, regex, choice and EBNF through the official
`openai` client (default model, tp=1, one server for the module), tp=3 equal to tp=1, ranks in
lockstep at tp=2, constrained requests leaving unconstrained ones' tokens alone (with overlap
scheduling and retraction), and bad input answered 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import httpx
import jsonschema
import openai
import pytest
import torch

from hf_reference import hf_greedy, mixed_prompts
from server_helpers import Server, api_server, openai_client
from structured_schemas import SCHEMAS

from minisgl import LLM, SamplingParams, StructuredOutput
from minisgl.engine.sampler import apply_token_bitmask
from minisgl.grammar.compiler import GrammarCache, TokenizerSource
from minisgl.grammar.matcher import full_bitmask
from minisgl.server.structured import FieldError, constraint

MAX_TOKENS = 64  # every schema's greedy answer ends well within it


def _ask(name: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": f"Answer in JSON: {name.replace('_', ' ')}."}]


def _json_format(name: str, schema: Dict[str, Any]) -> Dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


# --- no model --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,kind,spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": _json_format("p", {"type": "integer"})}, "json", '{"type": "integer"}'),
    ({"response_format": {"type": "text"}}, None, None),
    ({"guided_json": '{"type": "string"}'}, "json", '{"type": "string"}'),
    ({"guided_regex": "a+"}, "regex", "a+"), ({"regex": "b+"}, "regex", "b+"),
    ({"guided_choice": ["x", "y"]}, "choice", '["x", "y"]'),
    ({"choice": ["z"]}, "choice", '["z"]'),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"ebnf": 'root ::= "b"'}, "grammar", 'root ::= "b"'),
    ({"json_schema": '{"type": "null"}'}, "json", '{"type": "null"}'),
    ({"structured_outputs": {"choice": ["q"], "disable_any_whitespace": True}}, "choice",
     '["q"]'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ({"structured_outputs": {"grammar": 'root ::= "c"'}}, "grammar", 'root ::= "c"'),
])
def test_fields_become_one_constraint(extra: Dict[str, Any], kind: Any, spec: Any) -> None:
    found = constraint(extra)
    if kind is None:
        assert found is None
        return
    assert found is not None and found.structured == StructuredOutput(kind, spec)
    assert found.param == next(iter(extra))


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"choice": []}, "choice"), ({"regex": 5}, "regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
])
def test_malformed_or_two_constraints_name_the_field(extra: Dict[str, Any], param: str) -> None:
    with pytest.raises(FieldError) as e:
        constraint(extra)
    assert e.value.param == param


def test_bitmask_masks_only_cleared_bits() -> None:
    mask = full_bitmask(2, 70)
    mask[1] = 0
    mask[1, 0] = 0b101  # tokens 0 and 2
    mask[1, 2] = 1 << 5  # token 69
    logits = torch.randn(2, 70)
    out = apply_token_bitmask(logits, mask)
    assert torch.equal(out[0], logits[0])  # an all-set row is untouched
    assert out[1].isfinite().nonzero().flatten().tolist() == [0, 2, 69]


@pytest.mark.parametrize("structured", [StructuredOutput("json_object"), (constraint(
    {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}})
    or pytest.fail()).structured])
def test_json_object_admits_only_objects(default_model_dir: Path,
                                         structured: StructuredOutput) -> None:
    """json_object (and a json_schema without a schema) is any JSON object, as OpenAI promises:
    not an array, a string or null (xgrammar's built-in JSON grammar let "[null]" through)."""
    import xgrammar as xgr
    assert structured.kind == "json_object"
    compiled = GrammarCache(TokenizerSource(model_path=str(default_model_dir))).check(structured)
    assert xgr.GrammarMatcher(compiled).accept_string('{"a": [1, {"b": null}], "c": "d"}')
    assert xgr.GrammarMatcher(compiled).accept_string("{}")
    for bad in ("[null]", "null", '"text"', "3"):
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), bad


# --- the service ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    yield from api_server(tmp_path_factory.mktemp("structured-server"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server).with_options(timeout=600)  # 40 requests at once on 2 cores


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _schema_answer(client: openai.OpenAI, model: str, name: str, schema: Dict[str, Any],
                   stream: bool) -> Tuple[str, str]:
    kwargs: Dict[str, Any] = dict(model=model, messages=_ask(name), temperature=0,
                                  max_tokens=MAX_TOKENS,
                                  response_format=_json_format(name, schema))
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, finish = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.fixture(scope="module")
def schema_answers(client: openai.OpenAI, model: str) -> Dict[Tuple[str, bool], str]:
    """Every schema's answer, streamed and not, all in flight at once (40 requests)."""
    jobs = [(name, schema, stream) for name, schema in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _schema_answer(client, model, *j), jobs))
    for (name, _, stream), (text, finish) in zip(jobs, got):
        assert finish == "stop", (name, stream, text)
    return {(name, stream): text for (name, _, stream), (text, _) in zip(jobs, got)}


def test_twenty_json_schemas_validate_streamed_and_not(
        schema_answers: Dict[Tuple[str, bool], str]) -> None:
    for name, schema in SCHEMAS:
        for stream in (False, True):
            jsonschema.validate(json.loads(schema_answers[(name, stream)]), schema)
        assert schema_answers[(name, True)] == schema_answers[(name, False)], name


def test_regex_choice_and_ebnf_outputs_match(client: openai.OpenAI, model: str) -> None:
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    grammar = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [a-z]{2,5}'
    words = ["Paris", "London", "Berlin"]
    cases: List[Tuple[str, Dict[str, Any], Callable[[str], bool]]] = [
        ("completion", {"regex": regex}, lambda t: re.fullmatch(regex, t) is not None),
        ("chat", {"guided_regex": regex}, lambda t: re.fullmatch(regex, t) is not None),
        ("chat", {"guided_choice": words}, lambda t: t in words),
        ("completion", {"structured_outputs": {"choice": words}}, lambda t: t in words),
        ("chat", {"ebnf": grammar},
         lambda t: re.fullmatch(r"(hi|hello) [a-z]{2,5}", t) is not None),
        ("completion", {"structured_outputs": {"grammar": grammar}, "temperature": 1.0,
                        "seed": 3}, lambda t: re.fullmatch(r"(hi|hello) [a-z]{2,5}", t) is not None),
    ]
    def answer(endpoint: str, extra: Dict[str, Any]) -> Tuple[str, str]:
        body = {"temperature": 0, **extra}
        temperature = body.pop("temperature")
        if endpoint == "chat":
            resp = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Name a city."}],
                max_tokens=24, temperature=temperature, extra_body=body)
            return resp.choices[0].message.content or "", resp.choices[0].finish_reason
        done = client.completions.create(model=model, prompt="The city is", max_tokens=24,
                                         temperature=temperature, extra_body=body)
        return done.choices[0].text, done.choices[0].finish_reason

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: answer(c[0], c[1]), cases))
    for (_, extra, ok), (text, finish) in zip(cases, got):
        assert ok(text) and finish == "stop", (extra, text)


@pytest.mark.parametrize("extra,param,reason", [
    ({"response_format": _json_format("bad", {"type": "array", "minItems": 3, "maxItems": 1})},
     "response_format", "minItems"),
    ({"guided_json": {"type": "wibble"}}, "guided_json", "wibble"),
    ({"regex": "(unclosed"}, "regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "missing"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "both constrain"),
])
def test_bad_constraints_are_400_naming_the_field(server: Server, client: openai.OpenAI,
                                                  model: str, extra: Dict[str, Any], param: str,
                                                  reason: str) -> None:
    for path, body in (("/chat/completions", {"messages": _ask("x")}),
                       ("/completions", {"prompt": "x"})):
        for stream in (False, True):
            r = httpx.post(server.base_url + path, timeout=60,
                           json={"model": model, "max_tokens": 4, "stream": stream, **body,
                                 **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and reason in error["message"], error
    ok = client.chat.completions.create(model=model, messages=_ask("x"), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # the service goes on


# --- offline: tp=3 against tp=1, lockstep at tp=2, mixed batches, bad input ----------------------
TP3_SCHEMAS = [SCHEMAS[i] for i in (0, 14, 18)]  # short answers: a tp=3 step is slow on 2 cores


def test_tp3_equals_tp1_and_hf(schema_answers: Dict[Tuple[str, bool], str],
                               default_model_dir: Path) -> None:
    """The default model split three ways (9 heads, 3 KV heads: one each), ranks compared every
    step: unconstrained greedy tokens equal Hugging Face's, constrained answers the tp=1
    server's (one tp=3 start for both: three ranks take most of this test's time)."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                             structured=StructuredOutput("json", json.dumps(schema)))
              for _, schema in TP3_SCHEMAS]
    prompts = mixed_prompts(4, seed=4, lengths=(2, 9, 40, 75))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(None, device="cpu", tp=3, max_kv_tokens=4096, page_size=4, check_lockstep=True,
             show_progress=False) as llm:
        outs = llm.chat([_ask(name) for name, _ in TP3_SCHEMAS], params)
        plain = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert [o.text for o in outs] == [schema_answers[(name, False)] for name, _ in TP3_SCHEMAS]
    assert plain == hf_greedy(default_model_dir, prompts, 12)


def _lockstep_params() -> List[SamplingParams]:
    kinds = [StructuredOutput("regex", "[a-z]{3,8}( [a-z]{3,8}){2}"),
             StructuredOutput("json_object"),
             StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma delta"])),
             None]
    return [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=20 + i,
                           structured=kinds[i % len(kinds)]) for i in range(8)]


def test_tp2_constrained_ranks_agree(tiny_model: Callable[..., Path]) -> None:
    """Random sampling under masks on a random tiny model: check_lockstep makes the ranks
    compare batches and sampled tokens every step (a divergence fails the generate), and the
    outputs are those of tp=1."""
    prompts = [[15 + i, 300 + 7 * i, 2000 + i] for i in range(8)]
    params = _lockstep_params()
    outs = []
    for tp in (2, 1):
        with LLM(str(tiny_model("qwen3")), device="cpu", tp=tp, max_kv_tokens=2048,
                 check_lockstep=tp > 1, show_progress=False) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def small_pool_llm(default_model_dir: Path) -> Iterator[LLM]:
    """Overlap scheduling on (the mask of step N+1 built while step N's results come in) and a
    pool small enough that decoding retracts requests."""
    with LLM(None, device="cpu", max_kv_tokens=256, page_size=16, decode_reserve_tokens=8,
             overlap=True, show_progress=False) as llm:
        yield llm


def test_unconstrained_tokens_unchanged_by_constrained_neighbours(small_pool_llm: LLM) -> None:
    llm = small_pool_llm
    plain_chats = [[{"role": "user", "content": f"Tell me about {t}."}]
                   for t in ("rain", "chess", "bread")]
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)
    alone = [o.token_ids for o in llm.chat(plain_chats, [plain, seeded, plain])]
    schemas = [SCHEMAS[i] for i in (0, 3, 11)]
    constrained = [_ask(n) for n, _ in schemas]
    json_params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                  structured=StructuredOutput("json", json.dumps(s)))
                   for _, s in schemas]
    constrained_alone = llm.chat(constrained, json_params)
    before = llm.check_accounting().retracted_requests
    mixed = llm.chat(plain_chats + constrained, [plain, seeded, plain] + json_params)
    assert [o.token_ids for o in mixed[:3]] == alone
    assert [o.text for o in mixed[3:]] == [o.text for o in constrained_alone]
    for (_, schema), out in zip(schemas, mixed[3:]):
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.check_accounting().retracted_requests > before  # the retraction path ran


def test_offline_bad_constraints_raise_and_accounting_balances(small_pool_llm: LLM) -> None:
    llm = small_pool_llm
    for structured, reason in ((StructuredOutput("regex", "[a-"), "regex"),
                               (StructuredOutput("json", '{"type": "array", "minItems": 3, "maxItems": 1}'),
                                "json"),
                               (StructuredOutput("choice", "[]"), "choice"),
                               (StructuredOutput("xml", "<a/>"), "kind")):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=reason):
            llm.generate(["Hi", "there"], [SamplingParams(max_tokens=4),
                                           SamplingParams(max_tokens=4, structured=structured)])
    acct = llm.check_accounting()
    assert acct.live_requests == 0 and acct.reserved_pages == 0
    assert acct.free_rows == acct.total_rows
    out = llm.generate(["Yes or no?"], SamplingParams(
        temperature=0, max_tokens=8, structured=StructuredOutput("choice", '["yes", "no"]')))
    assert out[0].text in ("yes", "no") and out[0].finish_reason == "stop"
