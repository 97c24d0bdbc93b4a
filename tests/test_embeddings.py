"""Embeddings (`LLM.embed`, params.embed): the final norm's hidden state of a prompt's last token,
L2-normalized, equal to Hugging Face transformers' (float32, CPU) across chunked prefills, the
prefix cache and tp=2; requests for text and for embeddings share the engine. (The HTTP
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


@pytest.mark.parametrize("modes,refused", [({"pooling_mode_lasttoken": True}, None),
                                           ({"pooling_mode_mean_tokens": True}, "mean_tokens"),
                                           ({"pooling_mode_cls_token": True}, "cls_token")])
def test_sentence_transformers_pooling_other_than_last_is_refused(
        tiny_model: Callable[..., Path], tmp_path: Path, modes: dict,
        refused: str) -> None:
    """A sentence-transformers checkpoint whose Pooling module pools otherwise than by the
    last token (its vectors would not be the model's) gets a ValueError naming its pooling;
    by the last token, embeddings as usual."""
    import json
    import shutil
    path = tmp_path / "st"
    shutil.copytree(tiny_model("qwen3"), path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": False, **modes}))
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        if refused is None:
            assert len(llm.embed([[5, 6, 7]])[0].outputs.embedding) == 64
        else:
            with pytest.raises(ValueError, match=f"pooling is {refused}; minisgl embeds by "
                                                 f"the last token only"):
                llm.embed([[5, 6, 7]])


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
