"""Embeddings (`LLM.embed`, params.embed): the final norm's hidden state of a prompt's last token
(or their mean, or the first token's, as a sentence-transformers model pools), L2-normalized,
equal to Hugging Face transformers' (float32, CPU) across chunked prefills, the prefix cache and
tp=2; requests for text and for embeddings share the engine. (The HTTP
endpoint: test_server_api.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hf_reference import _hf_model, mixed_prompts
from minisgl import LLM, SamplingParams


def hf_embeddings(model_dir: Path, prompts: List[List[int]]) -> torch.Tensor:
    """[prompts, hidden]: transformers' last hidden state (after the final norm) of each
    prompt's last token, L2-normalized."""
    model = _hf_model(model_dir)
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state  # type: ignore
            rows.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1))
    return torch.stack(rows)


def _vectors(outs: list) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_embeddings_match_hf(tiny_model: Callable[..., Path], family: str) -> None:
    """Fresh prompts in 5-token chunks, then the same prompts again (their prefixes cached:
    only the last token is computed), beside requests for text."""
    path = tiny_model(family)
    prompts = mixed_prompts(4, seed=12, lengths=(3, 17, 40))
    want = hf_embeddings(path, prompts)
    with LLM(str(path), device="cpu", page_size=4, max_prefill_tokens=5, max_kv_tokens=4096,
             show_progress=False) as llm:
        first = llm.embed(prompts)
        text = llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))
        again = llm.embed(prompts)
        assert llm.check_accounting().live_requests == 0
    assert all(len(t.outputs[0].token_ids) == 4 for t in text)
    assert [o.prompt_token_ids for o in first] == prompts
    assert all(o.outputs.hidden_size == want.shape[1] for o in first)
    torch.testing.assert_close(_vectors(first), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_vectors(again), want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(_vectors(first).norm(dim=-1), torch.ones(len(prompts)))


def test_tp2_embeddings_match_tp1(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("qwen3")
    prompts = mixed_prompts(3, seed=13, lengths=(6, 25))
    with LLM(str(path), device="cpu", tp=2, page_size=4, max_kv_tokens=4096,
             show_progress=False) as llm:
        outs = llm.embed(prompts)
    torch.testing.assert_close(_vectors(outs), hf_embeddings(path, prompts), atol=1e-5,
                               rtol=1e-4)


def test_text_prompt_and_bad_input(tiny_model: Callable[..., Path]) -> None:
    """A text prompt is tokenized as `generate` tokenizes it; an empty prompt, or a token
    outside the vocabulary, is a ValueError naming it, and the engine goes on."""
    path = tiny_model("qwen3")
    with LLM(str(path), device="cpu", max_kv_tokens=2048, show_progress=False) as llm:
        ids = llm.get_tokenizer().encode("The sea is calm")
        out = llm.embed("The sea is calm")
        with pytest.raises(ValueError, match="empty"):
            llm.embed([[]])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed([[10 ** 7]])
        assert len(llm.embed([ids])) == 1
    assert out[0].prompt_token_ids == ids
    torch.testing.assert_close(_vectors(out), hf_embeddings(path, [ids]), atol=1e-5, rtol=1e-4)


def test_embed_params_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens must be 1, got 16"):
        SamplingParams(embed=True).validate()
    with pytest.raises(ValueError, match="embed must be true or false"):
        SamplingParams(max_tokens=1, embed="yes").validate()  # type: ignore[arg-type]


def test_a_checkpoint_of_the_bare_decoder_loads(tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """Embedding models (Qwen3-Embedding) are saved from the bare decoder: their tensors have
    no `model.` prefix. Such a checkpoint loads as the full model's does."""
    import shutil
    from safetensors.torch import load_file, save_file
    path = tiny_model("qwen3")
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()},
              str(bare / "model.safetensors"))
    prompts = mixed_prompts(2, seed=14, lengths=(5, 12))
    with LLM(str(bare), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        outs = llm.embed(prompts)
    torch.testing.assert_close(_vectors(outs), hf_embeddings(path, prompts), atol=1e-5,
                               rtol=1e-4)


def _sentence_transformers(model: Path, out: Path, modes: dict) -> Path:
    """A copy of `model` with sentence-transformers files whose Pooling module has `modes`."""
    import json
    import shutil
    shutil.copytree(model, out)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": False, **modes}))
    return out


def _hf_tokenizer(model_dir: Path) -> object:
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def hf_pooled(model_dir: Path, prompts: List[List[int]], pooling: str) -> torch.Tensor:
    """[prompts, hidden]: transformers' final hidden states of each prompt averaged over its
    tokens ("mean") or its first token's ("cls"), L2-normalized (what sentence-transformers
    computes for one unpadded input)."""
    model = _hf_model(model_dir)
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # type: ignore
            rows.append(torch.nn.functional.normalize(
                hidden.mean(0) if pooling == "mean" else hidden[0], dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("mode,pooling", [("mean_tokens", "mean"), ("cls_token", "cls")])
def test_mean_and_cls_pooling_match_hf(tiny_model: Callable[..., Path], tmp_path: Path,
                                       mode: str, pooling: str) -> None:
    """A sentence-transformers checkpoint pooling by the mean or the first token: its prompts
    in 5-token chunks, beside requests for text, then again after a request for text cached
    their prefixes (pooling the whole prompt reuses none: the vectors stay), at tp=1 and
    tp=2: transformers' pooled states. /score's cosines pool alike."""
    path = _sentence_transformers(tiny_model("qwen3"), tmp_path / "st", {f"pooling_mode_{mode}": True})
    prompts = mixed_prompts(4, seed=15, lengths=(3, 17, 40))
    want = hf_pooled(path, prompts, pooling)
    assert not torch.allclose(want, hf_embeddings(path, prompts), atol=1e-3)
    for tp in (1, 2):
        with LLM(str(path), device="cpu", tp=tp, page_size=4, max_prefill_tokens=5,
                 max_kv_tokens=4096, show_progress=False) as llm:
            first = llm.embed(prompts)
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
            again = llm.embed(prompts)
            assert llm.check_accounting().live_requests == 0
        torch.testing.assert_close(_vectors(first), want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_vectors(again), want, atol=1e-5, rtol=1e-4)


def test_embeddings_left_unnormalized_where_asked(tiny_model: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    """normalize false, from --pooler-config (the model's default), PoolingParams or the
    embeddings body (a request's own): the pooled state as transformers computes it, not
    L2-normalized (a Matryoshka cut stays unnormalized too); the others normalized."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    from minisgl import PoolingParams
    path = tiny_model("qwen3")
    prompts = mixed_prompts(2, seed=21, lengths=(5, 14))
    model = _hf_model(path)
    with torch.no_grad():
        raw = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0].mean(0)
                           for p in prompts])  # type: ignore
    normed = torch.nn.functional.normalize(raw, dim=-1)
    config = '{"pooling_type": "MEAN", "normalize": false}'
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False,
             pooler_config=config, hf_overrides='{"is_matryoshka": true}') as llm:
        torch.testing.assert_close(_vectors(llm.embed(prompts)), raw, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_vectors(llm.embed(prompts, pooling_params=PoolingParams(
            normalize=True))), normed, atol=1e-5, rtol=1e-4)
        cut = _vectors(llm.embed(prompts, pooling_params=PoolingParams(dimensions=8)))
        torch.testing.assert_close(cut, raw[:, :8], atol=1e-5, rtol=1e-4)
    with serving(["--model", str(path), *CPU_ARGS, "--pooler-config",
                  '{"pooling_type": "MEAN"}'], tmp_path) as srv:
        got = [httpx.post(f"{srv.url}/v1/embeddings", timeout=60, json={
            "input": prompts, "normalize": flag}).json()["data"] for flag in (False, None)]
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in got[0]]), raw,
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in got[1]]), normed,
                               atol=1e-5, rtol=1e-4)


def test_pooler_config_dimensions_cut_by_default(tiny_model: Callable[..., Path],
                                                 tmp_path: Path) -> None:
    """vLLM's pooler_config `dimensions`: a Matryoshka model's embeddings cut to that length
    (and normalized again) where a request names none, offline and served; a request's own
    `dimensions` stands; a length the model does not allow is refused at start-up."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    from minisgl import PoolingParams
    path = tiny_model("qwen3")
    prompts = mixed_prompts(2, seed=23, lengths=(6, 11))
    model = _hf_model(path)
    with torch.no_grad():
        raw = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1]
                           for p in prompts])  # type: ignore
    cut = [torch.nn.functional.normalize(raw[:, :d], dim=-1) for d in (8, 16)]
    matryoshka = '{"is_matryoshka": true}'
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False,
             pooler_config='{"dimensions": 8}', hf_overrides=matryoshka) as llm:
        torch.testing.assert_close(_vectors(llm.embed(prompts)), cut[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_vectors(llm.embed(prompts, pooling_params=PoolingParams(
            dimensions=16))), cut[1], atol=1e-5, rtol=1e-4)
    with serving(["--model", str(path), *CPU_ARGS, "--pooler-config", '{"dimensions": 8}',
                  "--hf-overrides", matryoshka], tmp_path) as srv:
        got = [httpx.post(f"{srv.url}/v1/embeddings", timeout=60, json={
            "input": prompts, **extra}).json()["data"] for extra in ({}, {"dimensions": 16})]
    for data, want in zip(got, cut):
        torch.testing.assert_close(torch.tensor([d["embedding"] for d in data]), want,
                                   atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions 4096: this model's embeddings may be cut "
                                         "to 1 to"):
        LLM(str(path), device="cpu", pooler_config='{"dimensions": 4096}',
            hf_overrides=matryoshka)


def test_served_embeddings_pool_as_the_model_does(tiny_model: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    """Served, a mean-pooling model's /v1/embeddings, /pooling and /score pool by the mean
    (transformers' pooled states, their cosines); --pooler-config CLS serves the first
    token's state instead."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    model = tiny_model("qwen3")
    path = _sentence_transformers(model, tmp_path / "st", {"pooling_mode_mean_tokens": True})
    prompts = mixed_prompts(2, seed=17, lengths=(6, 13))
    for extra, pooling in (([], "mean"), (["--pooler-config", '{"pooling_type": "cls"}'],
                                          "cls")):
        with serving(["--model", str(path), *CPU_ARGS, *extra], tmp_path) as srv:
            post = lambda route, body: httpx.post(f"{srv.url}{route}", json=body,  # noqa: E731
                                                  timeout=60).json()
            got = post("/v1/embeddings", {"input": prompts, "encoding_format": "float"})
            pooled = post("/pooling", {"input": prompts[:1]})
            score = post("/score", {"text_1": "a b", "text_2": "c d e"})
        want = hf_pooled(path, prompts, pooling)
        torch.testing.assert_close(torch.tensor([d["embedding"] for d in got["data"]]), want,
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), want[0],
                                   atol=1e-5, rtol=1e-4)
        tokenizer = _hf_tokenizer(path)
        a, b = hf_pooled(path, [tokenizer.encode(t) for t in ("a b", "c d e")], pooling)
        assert score["data"][0]["score"] == pytest.approx(float(a @ b), abs=1e-5)


def test_pooling_the_model_does_not_use_is_refused_and_pooler_config_overrides(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """A Pooling module of another mode (max) or of several is a ValueError naming them;
    vLLM's --pooler-config picks the pooling over the model's files (and a bad one is refused
    at start-up, naming it)."""
    model = tiny_model("qwen3")
    for name, modes, named in (("max", {"pooling_mode_max_tokens": True}, "max_tokens"),
                               ("two", {"pooling_mode_mean_tokens": True,
                                        "pooling_mode_cls_token": True}, "cls_token, mean")):
        path = _sentence_transformers(model, tmp_path / name, modes)
        with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
            with pytest.raises(ValueError, match=f"pooling is {named}.*; minisgl pools by "
                                                 f"lasttoken, mean_tokens, cls_token"):
                llm.embed([[5, 6, 7]])
            assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))) == 1
    prompts = mixed_prompts(2, seed=16, lengths=(9,))
    with LLM(str(tmp_path / "max"), device="cpu", max_kv_tokens=1024, show_progress=False,
             pooler_config='{"pooling_type": "MEAN"}') as llm:
        torch.testing.assert_close(_vectors(llm.embed(prompts)),
                                   hf_pooled(model, prompts, "mean"), atol=1e-5, rtol=1e-4)
    for bad, named in (('{"pooling_type": "MAX"}', "pooling_type must be one of LAST, MEAN, "
                                                    "CLS, got 'MAX'"),
                       ('{"normalize": 1}', "normalize must be true or false"),
                       ('{"step_tag_id": 3}', "step_tag_id is not supported"),
                       ('{"dimensions": 0}', "dimensions must be a positive integer"),
                       ('{"dimensions": 8}', "pooler_config: dimensions 8: this model's "
                                             "embeddings cannot be shortened"),
                       ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=named):
            LLM(str(model), device="cpu", pooler_config=bad)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        SamplingParams(embed=True, max_tokens=1, pooling="max").validate()


def test_matryoshka_dimensions(tiny_model: Callable[..., Path]) -> None:
    """A model config.json (or vLLM's hf_overrides) calls Matryoshka: an embedding cut to its
    first k values, normalized again; k outside its list, or any k for another model, is a
    ValueError naming it."""
    from minisgl import PoolingParams
    path = tiny_model("qwen3")
    prompts = mixed_prompts(2, seed=15, lengths=(6, 13))
    want = torch.nn.functional.normalize(hf_embeddings(path, prompts)[:, :16], dim=-1)
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False,
             hf_overrides={"matryoshka_dimensions": [16, 32]}) as llm:
        cut = llm.embed(prompts, pooling_params=PoolingParams(dimensions=16))
        with pytest.raises(ValueError, match="may be cut to 16, 32"):
            llm.embed(prompts, pooling_params=PoolingParams(dimensions=12))
    torch.testing.assert_close(_vectors(cut), want, atol=1e-5, rtol=1e-4)
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        with pytest.raises(ValueError, match="not a Matryoshka model"):
            llm.embed(prompts, pooling_params=PoolingParams(dimensions=16))


def test_http_formatter_cuts_and_encodes() -> None:
    """The endpoint's response: dimensions cut (any length for `is_matryoshka`), floats or
    base64 of the same float32 values."""
    import base64
    from array import array
    from minisgl.server.embeddings import EmbeddingFormatter, EmbeddingRequest, embeddings_job
    from minisgl.server.protocol import ApiError
    from minisgl.server.responses import Choice
    vector = array("f", [3.0, 4.0, 12.0]).tobytes()
    job = embeddings_job(EmbeddingRequest(input=[1, 2], dimensions=2), 3, matryoshka=())
    choice = Choice(prompt_tokens=2, embedding=vector)
    floats = EmbeddingFormatter("m", job, "float", 2).full([choice])
    assert floats["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
    assert floats["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    raw = EmbeddingFormatter("m", job, "base64", 2).full([choice])["data"][0]["embedding"]
    assert array("f", base64.b64decode(raw)).tolist() == pytest.approx([0.6, 0.8])
    with pytest.raises(ApiError, match="cannot be shortened"):
        embeddings_job(EmbeddingRequest(input=[1, 2], dimensions=2), 3)


def test_offline_score_is_the_cosine_of_the_embeddings(tiny_model: Callable[..., Path]) -> None:
    """vLLM's `LLM.score`: one text against several, and two lists in order."""
    path = tiny_model("qwen3")
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        vectors = _vectors(llm.embed(["a query", "doc one", "doc two"]))
        one = llm.score("a query", ["doc one", "doc two"])
        pairs = llm.score(["a query", "doc one"], ["doc two", "doc one"])
        with pytest.raises(ValueError, match="got 2 and 3 texts"):
            llm.score(["a", "b"], ["c", "d", "e"])
    assert [o.outputs.score for o in one] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])], abs=1e-5)
    assert [o.outputs.score for o in pairs] == pytest.approx(
        [float(vectors[0] @ vectors[2]), 1.0], abs=1e-5)
