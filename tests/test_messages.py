"""Every message type survives encode -> decode unchanged; token ids are packed compactly."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from minisgl.core import SamplingParams, StructuredOutput, TokenLogprobs
from minisgl.message import codec
from minisgl.message import types as T

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3,
                        ignore_eos=True, stop_token_ids=(5, 6), logprobs=3,
                        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                        logit_bias={5: -100.0, 70000: 2.5}, prompt_logprobs=0, min_tokens=2,
                        allowed_token_ids=(5, 9, 70000))
LOGPROBS = TokenLogprobs(-0.25, (7042, 260), (-0.25, -2.740744113922119), 1)
LOGPROB_TEXT = T.TokenLogprobText(" \ufffd", -0.25, (" \ufffd", " the"),
                                  (-0.25, -2.740744113922119), b" \xe6", (b" \xe6", None),
                                  7042, (7042, 260), 1)
STATS = T.SchedulerStats(running=2, waiting=3, kv_pages_used=4, kv_pages_total=512,
                         kv_pages_cached=9, prompt_tokens_total=100, generated_tokens_total=50,
                         cached_tokens_total=32, prefilled_tokens_total=68, waiting_tokens=70,
                         replica=1)
CHUNK = T.ReplyChunk(uid=9, text="héllo 🙂", token_ids=[1, 2, 70000], finish_reason="stop",
                     prompt_tokens=5, completion_tokens=3, cached_tokens=2, error=None,
                     error_status=400, logprobs=[LOGPROB_TEXT] * 3, prompt_text="héllo",
                     prompt_logprobs=[T.TokenLogprobText("h", None), LOGPROB_TEXT])

WIRE = T.WireTensor((2, 3), bytes(range(24)))

# One sample per registered type, with non-default values wherever a field has a default.
SAMPLES: Dict[str, Any] = {
    "TokenizeRequest": [
        T.TokenizeRequest(uid=1, params=PARAMS, text="hi", stop=("a", "bc"),
                          skip_special_tokens=False, echo=True),
        T.TokenizeRequest(uid=2, params=PARAMS, messages=[{"role": "user", "content": "x"}]),
        T.TokenizeRequest(uid=3, params=PARAMS, input_ids=[0, 1, 2 ** 31 - 1]),
        T.TokenizeRequest(uid=16, params=SamplingParams(max_tokens=None), text="as many as fit"),
    ],
    "AbortRequest": [T.AbortRequest(uid=4)],
    "TextRequest": [T.TextRequest(uid=13, text="hi"), T.TextRequest(uid=14, input_ids=[1, 2], skip_special_tokens=True),
                    T.TextRequest(uid=15, messages=[{"role": "user", "content": "x"}])],
    "UserMsg": [T.UserMsg(uid=5, input_ids=list(range(1000)), params=PARAMS)],
    "AbortMsg": [T.AbortMsg(uid=6)],
    "ShutdownMsg": [T.ShutdownMsg()],
    "TokenOut": [T.TokenOut(uid=7, token=42, finish_reason="length", prompt_tokens=3,
                            cached_tokens=1, error=None, logprobs=LOGPROBS,
                            prompt_logprobs=[LOGPROBS, TokenLogprobs(-3.0)]),
                 T.TokenOut(uid=8, error="too long"),
                 T.TokenOut(uid=9, token=5, times=T.PhaseTimes(0.25, 0.0625)),
                 T.TokenOut(uid=10, finish_reason="stop", tensor=WIRE)],
    "BatchTokenOut": [T.BatchTokenOut(items=[T.TokenOut(uid=1, token=2)], stats=STATS),
                      T.BatchTokenOut(items=[])],
    "SchedulerStats": [STATS],
    "TokenLogprobs": [LOGPROBS, TokenLogprobs(-1.5)],
    "PhaseTimes": [T.PhaseTimes(0.5, 1.25)],
    "WireTensor": [WIRE, T.WireTensor((), b"\x00\x00\x80?")],
    "WeightReadMsg": [T.WeightReadMsg(19, "model.norm.weight"), T.WeightReadMsg(20, "é", 3)],
    "TensorWeightsMsg": [T.TensorWeightsMsg(12, (b"\x80\x04rank0", b"rank1"))],
    "TokenLogprobText": [LOGPROB_TEXT],
    "ReplyChunk": [CHUNK, T.ReplyChunk(uid=10, token_ids=[], error="bad", error_status=404),
                   T.ReplyChunk(uid=11, finish_reason="stop", tensor=WIRE)],
    "SamplingParams": [PARAMS, SamplingParams(), SamplingParams(max_tokens=None),
                       SamplingParams(structured=StructuredOutput("json", '{"type": "object"}')),
                       SamplingParams(bad_words=("Paris",), bad_word_ids=((7042,), (38634, 5)),
                                      cache_salt="t", priority=-3)],
    "StructuredOutput": [StructuredOutput("regex", "[a-z]+"), StructuredOutput("json_object")],
    "DetokenizeInit": [T.DetokenizeInit(uid=11, prompt_tail=[1, 2, 3], stop=("\n\n", "END"),
                                        skip_special_tokens=False),
                       T.DetokenizeInit(uid=12, prompt_tail=[3], prompt_ids=[1, 2, 70000],
                                        echo=True)],
    "ReplyBatch": [T.ReplyBatch(chunks=[CHUNK], stats=STATS), T.ReplyBatch(chunks=[])],
    "ServiceDown": [T.ServiceDown("node 1: rank1 (pid 7) was killed by signal 9")],
    "Drain": [T.Drain(30.0), T.Drain(0.0)],
    "AccountingMsg": [T.AccountingMsg(seq=3)],
    "AccountingReply": [T.AccountingReply(3, 100, 20, 8, 128, 4, 250, 257, 1, 12, 2)],
    "AdapterMsg": [T.AdapterMsg(7, "sql", "/adapters/sql"), T.AdapterMsg(8, "sql")],
    "WeightsMsg": [T.WeightsMsg(4, "/ckpt/step-100")],
    "FlushCacheMsg": [T.FlushCacheMsg(5)],
    "SleepMsg": [T.SleepMsg(6, 2), T.SleepMsg(7)],
    "WakeMsg": [T.WakeMsg(8, ("weights",)), T.WakeMsg(9)],
    "GroupMsg": [T.GroupMsg(10, "g", "10.0.0.1", 29500, 1, 3, "gloo"),
                 T.GroupMsg(11, "g", leave=True)],
    "PauseMsg": [T.PauseMsg(13), T.PauseMsg(14, wait=True), T.PauseMsg(15, resume=True)],
    "ProfileMsg": [T.ProfileMsg(16, True, "run-20261207-013700"), T.ProfileMsg(17, False),
                   T.ProfileMsg(18, True, "x", num_steps=5, activities=("CPU", "MEM"),
                                with_stack=True, record_shapes=True, output_dir="/p/sub")],
    "GroupWeightsMsg": [T.GroupWeightsMsg(12, "g", ("a.weight", "b"), ("bfloat16", "float32"),
                                          ((4, 8), ()))],
    "ReplicaChange": [T.ReplicaChange(1, T.AdapterMsg(9, "é", "/a b/ü")),
                      T.ReplicaChange(0, T.WeightsMsg(3, "/w/ü")),
                      T.ReplicaChange(1, T.WakeMsg(4, ("kv_cache",))),
                      T.ReplicaChange(0, T.ProfileMsg(5, True, "é")),
                      T.ReplicaChange(1, T.WeightReadMsg(6, "lm_head.weight", 1))],
}


def test_every_registered_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(codec._TYPES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name: str) -> None:
    for msg in SAMPLES[name]:
        back = codec.decode(codec.encode(msg))
        assert type(back) is type(msg)
        assert back == msg


def test_token_ids_are_packed_as_int32() -> None:
    msg = T.UserMsg(uid=1, input_ids=list(range(70000, 71000)), params=SamplingParams())
    # plain msgpack: 5 bytes per id above 65535; the default params cost no field at all
    assert len(codec.encode(msg)) < 1000 * 4 + 100


def test_fields_at_their_defaults_stay_off_the_wire() -> None:
    """Only what a message sets travels (a step's 256 TokenOuts were 4x larger with every
    field); a value equal to the default but of another type travels, so it comes back as
    it went."""
    import msgpack
    wire = msgpack.unpackb(codec.encode(T.TokenOut(uid=7, token=3)), raw=False)
    assert wire == {"t": "TokenOut", "f": {"uid": 7, "token": 3}}
    params = SamplingParams(top_p=1, stop=("x",))  # int 1 where the default is 1.0
    wire = msgpack.unpackb(codec.encode(params), raw=False)
    assert wire["f"] == {"top_p": 1, "stop": ["x"]}
    back = codec.decode(codec.encode(params))
    assert back == params and type(back.top_p) is int


def test_unknown_type_is_rejected() -> None:
    import msgpack
    with pytest.raises(ValueError, match="unknown message type"):
        codec.decode(msgpack.packb({"t": "Nope", "f": {}}))


def test_wire_tensors_join_rows_once() -> None:
    """WireTensor.joined: the parts' rows in order (None parts skipped), one part as itself,
    none as None; rows of different shapes refused."""
    import torch
    from minisgl.message.tensors import from_wire, to_wire
    WireTensor = T.WireTensor
    parts = [torch.arange(6.0).view(2, 3), torch.arange(3.0).view(1, 3) + 10]
    joined = WireTensor.joined([to_wire(parts[0]), None, to_wire(parts[1])])
    assert joined is not None and torch.equal(from_wire(joined), torch.cat(parts))
    one = to_wire(parts[0])
    assert WireTensor.joined([None, one]) is one and WireTensor.joined([]) is None
    with pytest.raises(ValueError, match="do not stack"):
        WireTensor.joined([one, to_wire(torch.zeros(1, 4))])
