"""vLLM's bad_words: the tokens of each word (as the tokenizer spells it alone and after a
space), the engine's device-side ban of a word's last token after the rest of it, and the
whole path through the offline API and the server, with and without overlap scheduling."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Sequence

import httpx
import pytest
import torch

from server_helpers import Server, api_server

from minisgl import LLM, SamplingParams
from minisgl.core import MAX_BAD_WORD_TOKENS, Req
from minisgl.engine.bad_words import BadWords

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _req(words: Sequence[Sequence[int]]) -> Req:
    params = SamplingParams(bad_word_ids=tuple(tuple(w) for w in words))
    return Req(0, [1, 2], 2, params, ())


def test_the_engine_bans_a_words_last_token_after_the_rest() -> None:
    """(7, 8, 9): 9 is banned only right after 7, 8 (outputs, not the prompt); (5,) always;
    a request without bad words is untouched; history follows the sampled tokens."""
    bw = BadWords(rows=4, device=torch.device("cpu"))
    words, plain = _req([(7, 8, 9), (5,)]), _req([])
    bw.start(2, [3, 7])
    rows = torch.tensor([2, 3])
    logits = torch.zeros(2, 12)

    def banned() -> List[List[int]]:
        out = bw.apply(logits, rows, [words, plain])
        return [torch.isinf(r).nonzero().flatten().tolist() for r in out]

    assert banned() == [[5], []]
    bw.record(rows, torch.tensor([8, 8]), [words, plain])
    assert banned() == [[5, 9], []]
    bw.record(rows, torch.tensor([9, 1]), [words, plain])
    assert banned() == [[5], []]
    bw.start(2, [1] * 40 + [7, 8])  # a retracted request comes back with its outputs
    assert banned() == [[5, 9], []]
    assert bw.apply(logits, rows, [plain, plain]) is logits


@pytest.mark.parametrize("order", [1, -1])
def test_words_sharing_a_last_token_never_undo_each_others_ban(order: int) -> None:
    """("Paris", "in Paris"): the one-token word bans always, whatever the other's prefix
    and the order the words come in (a review found the second one's miss undid it)."""
    bw = BadWords(rows=2, device=torch.device("cpu"))
    bw.start(1, [3])
    req = _req([(9,), (7, 9)][::order])
    out = bw.apply(torch.zeros(1, 12), torch.tensor([1]), [req])
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [9]


def test_a_word_of_the_longest_length_spans_the_whole_history() -> None:
    word = list(range(100, 100 + MAX_BAD_WORD_TOKENS))
    bw = BadWords(rows=2, device=torch.device("cpu"))
    bw.start(1, word[:-1])
    out = bw.apply(torch.zeros(1, 200), torch.tensor([1]), [_req([word])])
    assert torch.isinf(out[0, word[-1]]) and torch.isinf(out[0]).sum() == 1


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(default_model_dir), max_kv_tokens=4096, page_size=16,
             show_progress=False) as engine:
        yield engine


def _contains(ids: Sequence[int], word: Sequence[int]) -> bool:
    return any(tuple(ids[i:i + len(word)]) == tuple(word) for i in range(len(ids)))


@pytest.mark.parametrize("overlap", [False, True])
def test_offline_outputs_never_write_a_bad_word(default_model_dir: Path, overlap: bool) -> None:
    """Greedy "Paris" becomes another word; the three-token "capital of France" is cut after
    "capital of" (the device-side history, also with overlap, where the newest token is
    still only on the device when the next step is planned); other requests in the batch
    are untouched; pages balance."""
    with LLM(str(default_model_dir), max_kv_tokens=4096, page_size=16, overlap=overlap,
             show_progress=False) as llm:
        free = SamplingParams(max_tokens=30, temperature=0)
        ref = llm.chat(PARIS, free)[0]
        assert "Paris" in ref.text and "capital of France" in ref.text
        no_paris, no_phrase, untouched = llm.chat([PARIS] * 3, [
            SamplingParams(max_tokens=30, temperature=0, bad_words=["Paris"]),
            SamplingParams(max_tokens=30, temperature=0, bad_words=["capital of France"]),
            free])
        tok = llm.tokenizer
        assert "Paris" not in no_paris.text
        assert not any(_contains(no_paris.token_ids, tok.encode(w, add_special_tokens=False))
                       for w in ("Paris", " Paris"))
        assert "capital of France" not in no_phrase.text and "capital of" in no_phrase.text
        both = llm.chat(PARIS, SamplingParams(max_tokens=30, temperature=0,
                                              bad_words=["Paris", "in Paris"]))[0]
        assert "Paris" not in both.text
        assert untouched.token_ids == ref.token_ids
        s = llm.check_accounting()
        assert s.live_requests == 0 and s.free_rows == s.total_rows


def test_bad_words_that_cannot_be_served_are_refused(llm: LLM) -> None:
    long_word = " ".join(["antidisestablishmentarianism"] * 6)
    with pytest.raises(ValueError, match="prompt 0: a bad word may be at most 16 tokens"):
        llm.generate("a", SamplingParams(max_tokens=2, bad_words=[long_word]))
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        llm.generate("a", SamplingParams(max_tokens=2, bad_words=["  "]))
    with pytest.raises(ValueError, match="bad_words takes at most 128 words"):
        llm.generate("a", SamplingParams(max_tokens=2, bad_words=["x"] * 129))
    assert llm.check_accounting().live_requests == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    yield from api_server(tmp_path_factory.mktemp("bad-words"))


def test_the_server_takes_vllms_bad_words(server: Server) -> None:
    body = {"messages": PARIS, "max_tokens": 30, "temperature": 0}
    ref = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60).json()
    assert "Paris" in ref["choices"][0]["message"]["content"]
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={**body, "bad_words": ["Paris"]})
    assert r.status_code == 200 and "Paris" not in r.json()["choices"][0]["message"]["content"]
    for bad in (["x" * 200], "Paris", [3]):
        r = httpx.post(f"{server.base_url}/completions", timeout=60,
                       json={"prompt": "a", "max_tokens": 2, "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
