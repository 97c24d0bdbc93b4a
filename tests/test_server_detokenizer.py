"""The tokenizer and detokenizer logic without processes: incremental decoding (UTF-8, spacing)
for byte-level BPE and SentencePiece tokenizers, stop strings, per-request state, validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest

from bos_tokenizer import with_bos

from minisgl.core import Limits, SamplingParams, TokenLogprobs
from minisgl.message.types import DetokenizeInit, TokenizeRequest, TokenOut
from minisgl.tokenizer.detokenize_worker import Detokenizer
from minisgl.tokenizer.incremental import IncrementalDecoder, StopMatcher
from minisgl.tokenizer.text import load_tokenizer
from minisgl.tokenizer.tokenize_worker import Tokenizer


def _limits(max_context: int, kv_capacity: int) -> Limits:
    """The ranks' limits as the tokenizer gets them; the vocabulary is the tokenizer's."""
    return Limits(max_context, 2 ** 31 - 1, kv_capacity // 16, 16, 8192)


@pytest.fixture(scope="module")
def bpe(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def sentencepiece() -> Any:
    """A Llama-2-style SentencePiece tokenizer: '▁' word boundaries, byte fallback, and a
    decoder that strips the leading space (so decoding a lone '▁world' gives 'world')."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces += [(w, -2.0) for w in ("▁Hello", "▁world", "▁the", "▁cat", "▁sat", "▁ok", "Hello")]
    pieces += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,.!?▁"]
    raw = RawTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


CONTINUATIONS = [" world, café 🙂 ok 𝔘", " the cat sat 龘龘 naïve ok", "!? ÆØÅ 🙂🙂 world 龘"]


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
@pytest.mark.parametrize("cont", CONTINUATIONS)
def test_incremental_decode_is_exact_and_never_broken(kind: str, cont: str,
                                                      request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(kind)
    prompt_ids = tok.encode("Hello", add_special_tokens=False)
    all_ids = tok.encode("Hello" + cont, add_special_tokens=False)
    assert all_ids[:len(prompt_ids)] == prompt_ids
    out = all_ids[len(prompt_ids):]
    dec = IncrementalDecoder(tok, prompt_ids[-5:], skip_special_tokens=True)
    deltas = [dec.push(t) for t in out]
    text = "".join(deltas) + dec.flush()
    assert text == cont  # the first token's leading space survives, for SentencePiece too
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some token ended inside a multibyte character and was held back


def test_sentencepiece_lone_token_loses_its_space(sentencepiece: Any) -> None:
    """Why the decoder keeps left context: decoding '▁world' alone drops the space."""
    (world,) = sentencepiece.encode("world", add_special_tokens=False)[-1:]
    assert sentencepiece.decode([world]) == "world"
    assert IncrementalDecoder(sentencepiece, sentencepiece.encode("Hello")[-5:], True).push(
        world) == " world"


def test_long_output_trims_its_window(bpe: Any) -> None:
    ids = bpe.encode("word " * 300, add_special_tokens=False)
    dec = IncrementalDecoder(bpe, [], True)
    assert "".join(dec.push(t) for t in ids) + dec.flush() == "word " * 300
    assert len(dec.ids) < 80


def test_stop_matcher_across_deltas() -> None:
    m = StopMatcher(["capital", "zzz"])
    assert m.feed("The c") == ("The ", False)  # "c" could start "capital": held
    assert m.feed("api") == ("", False)
    assert m.feed("tal of") == ("", True)
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("d") == ("abd", False)  # not a stop after all: released
    assert m.feed("ab") == ("", False)
    assert m.flush() == "ab"
    m = StopMatcher(["lo w", "o"])
    assert m.feed("hello world") == ("hel", True)  # the earliest match wins
    assert StopMatcher([]).feed("anything") == ("anything", False)
    m = StopMatcher(["ab"])  # not armed (min_tokens): nothing stops, a partial stop is held
    assert m.feed("xab", armed=False) == ("xab", False)
    assert m.feed("ya", armed=False) == ("y", False)
    assert m.feed("b", armed=True) == ("", True)  # completed once armed: it stops


def test_min_tokens_holds_stop_strings_back(bpe: Any) -> None:
    """vLLM's min_tokens also holds stop strings back: one ending within the first
    min_tokens tokens does not count, the next one does."""
    ids = bpe.encode(" a. b. c. d.", add_special_tokens=False)
    dot = ids.index(bpe.encode(".", add_special_tokens=False)[0])
    d = Detokenizer(bpe)
    d.init(DetokenizeInit(1, [5, 6], (".",), True, min_tokens=dot + 1))
    r = d.render([TokenOut(1, t, None, 3) for t in ids])
    assert "".join(c.text for c in r.chunks) == " a. b" and r.aborts == [1]


def _outs(uid: int, tokens: List[int], last_reason: str) -> List[TokenOut]:
    outs = [TokenOut(uid, t, None, 3) for t in tokens]
    outs[-1] = TokenOut(uid, tokens[-1], last_reason, 3, 1)
    return outs


@pytest.mark.parametrize("interval,sizes", [(1, [1] * 11), (4, [1, 4, 4, 1, 1]),
                                             (0, [1, 9, 1]), (20, [1, 9, 1])])
def test_chunks_carry_stream_interval_tokens(bpe: Any, interval: int, sizes: List[int]
                                              ) -> None:
    """--stream-interval (0: a reply the client waits for whole): the first chunk goes at
    once, then one a `interval` tokens, the finishing one on its own after what waits; text,
    ids and log-probabilities are those of one chunk a token, joined."""
    ids = bpe.encode(" The capital of France is Paris, a city on the Seine.",
                     add_special_tokens=False)[:11]
    assert len(ids) == 11
    lp = TokenLogprobs(-0.5, (7,), (-0.5,))
    outs = [TokenOut(1, t, None, 3, logprobs=lp) for t in ids]
    outs[-1] = TokenOut(1, ids[-1], "length", 3, logprobs=lp)
    d = Detokenizer(bpe)
    d.init(DetokenizeInit(1, [5], stream_interval=interval))
    chunks = d.render(outs).chunks
    assert [len(c.token_ids) for c in chunks] == sizes
    assert [len(c.logprobs) for c in chunks] == sizes
    assert "".join(c.text for c in chunks) == bpe.decode(ids)
    assert [c.token_ids for c in chunks][0] == ids[:1] and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == ids


def test_detokenizer_state_lifecycle(bpe: Any) -> None:
    d = Detokenizer(bpe)
    ids = bpe.encode(" The capital of France is Paris.", add_special_tokens=False)
    # a TokenOut that overtakes its init waits for it
    early = d.render([TokenOut(1, ids[0], None, 3)])
    assert early.chunks == [] and 1 in d.pending
    r = d.init(DetokenizeInit(1, [5, 6], ("France",), True))
    assert r.chunks[0].text == " The" and not d.pending
    r = d.render([TokenOut(1, t, None, 3) for t in ids[1:]])
    text = "".join(c.text for c in r.chunks)
    assert text == " capital of "
    assert r.aborts == [1]  # rank 0 must stop it
    stop_chunks = [c for c in r.chunks if c.finish_reason]
    assert len(stop_chunks) == 1 and stop_chunks[0].finish_reason == "stop"
    assert stop_chunks[0].completion_tokens == ids.index(bpe.encode(" France")[0]) + 1
    # later tokens are dropped; the final TokenOut (the abort) frees the state
    assert d.render([TokenOut(1, 42, None, 3)]).chunks == []
    assert d.render([TokenOut(1, -1, "abort", 3)]).chunks == []
    assert 1 not in d.requests


def test_detokenizer_finish_abort_and_error_free_state(bpe: Any) -> None:
    d = Detokenizer(bpe)
    for uid in (1, 2, 3):
        d.init(DetokenizeInit(uid, [], (), False))
    eos = bpe.eos_token_id
    r = d.render(_outs(1, [bpe.encode("Hi")[0], eos], "stop"))
    assert "".join(c.text for c in r.chunks) == "Hi"  # the stop token is not rendered
    assert r.chunks[-1].finish_reason == "stop" and r.chunks[-1].cached_tokens == 1
    r = d.render([TokenOut(2, -1, "abort", 3)])
    assert r.chunks[0].finish_reason == "abort" and r.chunks[0].token_ids == []
    r = d.render([TokenOut(3, error="too long")])
    assert r.chunks[0].error == "too long" and r.chunks[0].error_status == 400
    assert d.requests == {} and d.pending == {}


def test_tokenizer_validation(bpe: Any) -> None:
    t = Tokenizer(bpe, _limits(max_context=100, kv_capacity=64))
    p = SamplingParams(max_tokens=10)
    ok = t.prepare(TokenizeRequest(1, p, text="hello world"))
    assert ok.error is None and ok.params.max_tokens == 10
    auto = t.prepare(TokenizeRequest(2, SamplingParams(max_tokens=None), text="a b"))
    assert auto.params.max_tokens == 64 - len(auto.input_ids)  # the KV pool is the limit
    long = t.prepare(TokenizeRequest(3, SamplingParams(max_tokens=50), input_ids=[1] * 60))
    assert "maximum context length is 100" in long.error and "110" in long.error
    kv = t.prepare(TokenizeRequest(4, SamplingParams(max_tokens=20), input_ids=[1] * 60))
    assert "holds only 64" in kv.error
    assert t.prepare(TokenizeRequest(5, p, text="")).error == "the prompt is empty"
    assert "outside the vocabulary" in t.prepare(TokenizeRequest(6, p, input_ids=[10 ** 7])).error
    full = t.prepare(TokenizeRequest(7, SamplingParams(max_tokens=None), input_ids=[1] * 64))
    assert "leaves no room" in full.error
    big = Tokenizer(bpe, _limits(max_context=8192, kv_capacity=16384))
    capped = big.prepare(TokenizeRequest(8, SamplingParams(max_tokens=None),
                                         input_ids=[1] * 100))
    assert capped.params.max_tokens == 1024  # an eighth of the context: requests share the pool
    chat = t.prepare(TokenizeRequest(8, p, messages=[{"role": "user", "content": "hi"}]))
    assert chat.error is None and chat.input_ids[-4:] == bpe.encode("<|im_start|>assistant\n")


def test_text_requests_answer_without_generating(bpe: Any) -> None:
    """The tokenizer process answers /tokenize and /detokenize itself; a model without a
    tokenizer says so, and ids outside the vocabulary are named."""
    from minisgl.message.types import TextRequest
    logic = Tokenizer(bpe, _limits(max_context=64, kv_capacity=64))
    ids = bpe.encode("hello there", add_special_tokens=False)
    tok = logic.answer(TextRequest(1, text="hello there"))
    assert (tok.token_ids, tok.finish_reason, tok.error) == (ids, "stop", None)
    assert logic.answer(TextRequest(2, input_ids=ids)).text == "hello there"
    bad = logic.answer(TextRequest(3, input_ids=[len(bpe) + 5]))
    assert bad.error is not None and f"token id {len(bpe) + 5} is outside" in bad.error
    bare = Tokenizer(None, _limits(max_context=64, kv_capacity=64)).answer(
        TextRequest(4, input_ids=[1]))
    assert bare.error is not None and "no tokenizer" in bare.error


def test_special_tokens_are_added_where_the_request_asks(bpe: Any) -> None:
    """TokenizeRequest / TextRequest add_special_tokens: a text prompt gets the tokenizer's BOS
    (completions' default); chat messages get it in front of the template's own tokens (vLLM's
    add_special_tokens on a chat); neither without it."""
    from minisgl.message.types import TextRequest
    tok = with_bos(bpe)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    logic = Tokenizer(tok, _limits(max_context=64, kv_capacity=64))
    p = SamplingParams(max_tokens=4)
    plain = bpe.encode("Hello world", add_special_tokens=False)
    assert logic.prepare(TokenizeRequest(1, p, text="Hello world", add_special_tokens=True)
                         ).input_ids == [bos, *plain]
    assert logic.prepare(TokenizeRequest(2, p, text="Hello world")).input_ids == plain
    assert logic.answer(TextRequest(3, text="Hello world", add_special_tokens=True)
                        ).token_ids == [bos, *plain]
    chat = [{"role": "user", "content": "hi"}]
    templated = logic.prepare(TokenizeRequest(4, p, messages=chat)).input_ids
    assert templated[0] != bos
    assert logic.prepare(TokenizeRequest(5, p, messages=chat, add_special_tokens=True)
                         ).input_ids == [bos, *templated]


def test_logprob_tokens_carry_the_bytes_of_partial_characters(bpe: Any) -> None:
    """日 is three byte-level tokens, each U+FFFD alone: their logprob entries carry the raw
    bytes, which join back into the text (OpenAI's `bytes`); whole-character tokens carry none
    (their text's UTF-8 is their bytes). SentencePiece's <0xNN> byte tokens too."""
    from minisgl.core import TokenLogprobs
    from minisgl.server.responses import chat_logprobs
    from minisgl.tokenizer.token_bytes import token_bytes
    ids = bpe.encode(" 日本 and more", add_special_tokens=False)
    det = Detokenizer(bpe)
    det.init(DetokenizeInit(uid=1, prompt_tail=[]))
    outs = [TokenOut(1, t, logprobs=TokenLogprobs(-1.0, (t,), (-1.0,))) for t in ids]
    entries = [e for c in det.render(outs).chunks for e in c.logprobs]
    assert any(e.token_bytes is not None for e in entries)  # the split character
    assert all(e.token_bytes is None for e in entries if "\ufffd" not in e.token)
    content = chat_logprobs(entries)["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == " 日本 and more"
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]

    class Pieces:  # a SentencePiece-style vocabulary with byte fallback
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {7: "<0xE6>", 8: "\u2581word"}[token_id]
    assert token_bytes(Pieces(), 7, "\ufffd") == b"\xe6"
    assert token_bytes(Pieces(), 8, "word") is None  # whole text: no bytes needed
    assert token_bytes(None, 7, "\ufffd") is None
