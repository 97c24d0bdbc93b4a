"""Sequence classification models (models/classifier.py): a `*ForSequenceClassification`
checkpoint's label probabilities, and a causal LM turned reranker by vLLM's hf_overrides
(Qwen3-Reranker's "no" / "yes" recipe) scoring pairs as a cross-encoder, both against Hugging
Face transformers in float32 on the CPU, at tp=1 and tp=2; what such a model cannot do is
refused naming it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hf_reference import mixed_prompts
from minisgl import LLM
from minisgl.models import ModelConfig
from minisgl.models.classifier import parse_classifier, probabilities
from tiny_models import BASE

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random tiny Qwen3ForSequenceClassification of three named labels, with the default
    model's tokenizer."""
    import transformers
    out = tmp_path_factory.mktemp("classifier")
    config = transformers.Qwen3Config(**{**BASE, "head_dim": 32, "pad_token_id": None},
                                      id2label={0: "negative", 1: "neutral", 2: "positive"})
    torch.manual_seed(3)
    model = transformers.Qwen3ForSequenceClassification(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


def _hf_logits(path: Path, prompts: List[List[int]], causal: bool = False) -> List[torch.Tensor]:
    import transformers
    cls = (transformers.AutoModelForCausalLM if causal
           else transformers.AutoModelForSequenceClassification)
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0, -1] if causal
                else model(torch.tensor([ids])).logits[0] for ids in prompts]


@pytest.mark.parametrize("tp", [1, 2])
def test_classifier_probabilities_match_hf(classifier_dir: Path, tp: int) -> None:
    prompts = mixed_prompts(4, seed=9, lengths=(3, 11, 40))
    want = [torch.softmax(x, dim=-1).tolist() for x in _hf_logits(classifier_dir, prompts)]
    with LLM(str(classifier_dir), device="cpu", tp=tp, max_kv_tokens=1024,
             show_progress=False) as llm:
        assert llm.model_config.classifier is not None
        assert llm.model_config.classifier.labels == ("negative", "neutral", "positive")
        got = llm.classify(prompts)
        rewards = llm.reward(prompts)  # the raw logits
        assert [o.prompt_token_ids for o in got] == prompts
        with pytest.raises(ValueError, match="sequence classifier .* use classify or score"):
            llm.embed(["hello"])
        with pytest.raises(ValueError, match="one-label classifier .* 3 labels"):
            llm.score("a", ["b"])
    for o, w in zip(got, want):
        assert o.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(o.outputs.probs), torch.tensor(w),
                                   rtol=1e-5, atol=1e-6)
    for r, logits in zip(rewards, _hf_logits(classifier_dir, prompts)):
        torch.testing.assert_close(torch.tensor(r.outputs.data), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "glm4", "phi3", "qwen3_moe",
                                    "mixtral", "smollm3"])
def test_every_familys_classifier_matches_hf(family: str, tmp_path: Path) -> None:
    """Each family's *ForSequenceClassification (Gemma 2's: reward models such as
    Skywork-Reward-Gemma-2; its logit softcapping is the LM head's, not the score head's;
    Phi-3's fused tensors; the mixtures of experts): HF's label probabilities and raw
    logits."""
    from tiny_models import build_tiny
    path = build_tiny(family, tmp_path / family, None, labels=("bad", "good"))
    prompts = mixed_prompts(3, seed=10, lengths=(4, 23))
    with LLM(str(path), device="cpu", max_kv_tokens=1024, show_progress=False) as llm:
        assert llm.model_config.classifier is not None
        got = [o.outputs.probs for o in llm.classify(prompts)]
        rewards = [o.outputs.data for o in llm.reward(prompts)]
    logits = _hf_logits(path, prompts)
    torch.testing.assert_close(torch.tensor(rewards), torch.stack(logits), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(torch.tensor(got), torch.softmax(torch.stack(logits), -1),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_reranker_from_tokens_scores_pairs_as_hf_yes_over_no(
        tiny_model: Callable[..., Path], tp: int) -> None:
    """hf_overrides make a causal LM Qwen3-Reranker-style: a pair's score is the softmax
    probability of "yes" against "no" at the last token of the pair's tokens (the tokenizer's
    pair encoding of query and document), as the causal LM computes it."""
    path = tiny_model("qwen3")
    query, docs = "what is a cat", ["a cat is a small animal", "the stock market fell", "x"]
    with LLM(str(path), device="cpu", tp=tp, max_kv_tokens=1024, show_progress=False,
             hf_overrides=json.dumps(RERANKER)) as llm:
        tokenizer = llm.get_tokenizer()
        pairs = [list(tokenizer.encode(query, d, add_special_tokens=True)) for d in docs]
        scores = [o.outputs.score for o in llm.score(query, docs)]
        no, yes = (tokenizer.convert_tokens_to_ids(t) for t in ("no", "yes"))
    logits = _hf_logits(path, pairs, causal=True)
    want = [float(torch.softmax(x[[no, yes]], dim=-1)[1]) for x in logits]
    assert scores == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(set(scores)) == 3


def test_use_activation_and_logit_scaling(classifier_dir: Path) -> None:
    """vLLM's pooler_config `use_activation` false (or its older `activation` / `softmax`):
    classify answers the logits (HF's); `logit_mean` / `logit_sigma` standardize them before
    the softmax; a call's `PoolingParams(use_activation=...)` overrides the config; embedding
    options in a classify call, or use_activation in an embedding call, are refused."""
    from minisgl import PoolingParams
    prompts = mixed_prompts(3, seed=12, lengths=(4, 19))
    logits = _hf_logits(classifier_dir, prompts)
    kw = dict(device="cpu", max_kv_tokens=1024, show_progress=False)
    config = '{"activation": false, "logit_mean": 0.5, "logit_sigma": 2.0}'
    with LLM(str(classifier_dir), pooler_config=config, **kw) as llm:  # type: ignore[arg-type]
        raw = [o.outputs.probs for o in llm.classify(prompts)]
        scaled = [o.outputs.probs for o in llm.classify(
            prompts, pooling_params=PoolingParams(use_activation=True))]
        with pytest.raises(ValueError, match="dimensions and normalize apply to embeddings"):
            llm.classify(prompts, pooling_params=PoolingParams(dimensions=4))
    for got, want in zip(raw, logits):
        torch.testing.assert_close(torch.tensor(got), (want - 0.5) / 2.0, rtol=1e-5, atol=1e-5)
    for got, want in zip(scaled, logits):
        torch.testing.assert_close(torch.tensor(got), torch.softmax((want - 0.5) / 2.0, -1),
                                   rtol=1e-5, atol=1e-6)


def test_pooler_config_activation_settings_are_checked() -> None:
    from minisgl.models.classifier import LogitActivation
    from minisgl.models.pooling import parse_pooler_config
    assert parse_pooler_config('{"softmax": false}').logits == LogitActivation(False)
    assert parse_pooler_config('{"use_activation": true, "activation": true}').logits == (
        LogitActivation())
    assert parse_pooler_config('{"logit_mean": 1, "logit_sigma": 0.5}').logits == (
        LogitActivation(True, 1.0, 0.5))
    for bad, named in (('{"use_activation": "no"}', "use_activation must be true or false"),
                       ('{"use_activation": true, "softmax": false}', "disagree"),
                       ('{"logit_sigma": 0}', "logit_sigma must be above 0"),
                       ('{"logit_mean": "1"}', "logit_mean must be a finite number"),
                       ('{"logit_sigma": true}', "logit_sigma must be a finite number")):
        with pytest.raises(ValueError, match=named):
            parse_pooler_config(bad)
    act = LogitActivation(False, 1.0, 2.0)
    assert act.score(3.0) == 1.0 and act.probabilities([1.0, 5.0]) == [0.0, 2.0]
    assert act.for_request(True).score(1.0) == 0.5
    assert act.for_request(None) == act


def test_classifier_configs_read_as_vllm_reads_them() -> None:
    arch = "Qwen3ForSequenceClassification"
    assert parse_classifier({}, "Qwen3ForCausalLM") is None
    assert parse_classifier({}, arch).labels == ("LABEL_0", "LABEL_1")  # HF's default two
    assert parse_classifier({"num_labels": 1}, arch).labels == ("LABEL_0",)
    two = parse_classifier({"classifier_from_token": ["no", "yes"], "method":
                            "from_2_way_softmax"}, arch)
    assert two.two_way and two.labels == ("score",)
    assert parse_classifier({"classifier_from_token": ["a", "b", "c"]}, arch).num_labels == 3
    with pytest.raises(ValueError, match="two classifier_from_token"):
        parse_classifier({"classifier_from_token": ["yes"], "is_original_qwen3_reranker": 1},
                         arch)
    assert probabilities([0.0]) == [0.5]
    assert probabilities([0.0, 0.0]) == [0.5, 0.5]


def test_reranker_tokens_missing_from_the_vocabulary_are_refused(
        tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match=r"classifier_from_token \['zzqqxx'\] not in"):
        ModelConfig.from_dir(tiny_model("qwen3"), {**RERANKER,
                                                   "classifier_from_token": ["no", "zzqqxx"]})


def test_classify_needs_a_classifier(tiny_model: Callable[..., Path]) -> None:
    with LLM(str(tiny_model("qwen3")), device="cpu", max_kv_tokens=512,
             show_progress=False) as llm:
        with pytest.raises(ValueError, match="classify needs a sequence classification model"):
            llm.classify(["hello"])
        with pytest.raises(ValueError, match="reward needs a sequence classification model"):
            llm.reward(["hello"])


def test_served_reranker_scores_reranks_and_classifies(tiny_model: Callable[..., Path],
                                                       tmp_path: Path) -> None:
    """The reranker served: /score and /rerank as a cross-encoder (each pair tokenized as the
    tokenizer pairs two texts, then HF's yes-over-no), /classify its one label's sigmoid (the
    logits themselves with `use_activation` false, which /pooling refuses); the embeddings
    endpoint refuses it, and a bad body gets a 400 naming its field."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    path = tiny_model("qwen3")
    query, docs = "what is a cat", ["a cat is a small animal", "the stock market fell", "x"]
    args = ["--model", str(path), *CPU_ARGS, "--hf-overrides", json.dumps(RERANKER)]
    with serving(args, tmp_path) as srv:
        post = lambda route, body: httpx.post(f"{srv.url}{route}", json=body,  # noqa: E731
                                              timeout=60)
        scores = [d["score"] for d in post("/score", {"text_1": query,
                                                      "text_2": docs}).json()["data"]]
        ranked = post("/v1/rerank", {"query": query, "documents": docs}).json()["results"]
        classified = post("/classify", {"input": [query, "a dog"]}).json()
        pooled = post("/pooling", {"input": query}).json()
        refused = post("/v1/embeddings", {"input": "hello"})
        bad = post("/classify", {"input": []})
        # vLLM's use_activation false: the cross-encoder's logit, classify's logits
        raw_scores = [d["score"] for d in post("/score", {
            "text_1": query, "text_2": docs, "use_activation": False}).json()["data"]]
        raw_class = post("/classify", {"input": query, "use_activation": False}).json()
        not_pooling = post("/pooling", {"input": query, "use_activation": False})
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    pairs = [list(tokenizer.encode(query, d, add_special_tokens=True)) for d in docs]
    no, yes = (tokenizer.convert_tokens_to_ids(t) for t in ("no", "yes"))
    want = [float(torch.softmax(x[[no, yes]], dim=-1)[1])
            for x in _hf_logits(path, pairs, causal=True)]
    assert scores == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -want[i])
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(want, reverse=True),
                                                                    rel=1e-5, abs=1e-6)
    ids = list(tokenizer.encode(query, add_special_tokens=True))
    one = float(torch.softmax(_hf_logits(path, [ids], causal=True)[0][[no, yes]], dim=-1)[1])
    entry = classified["data"][0]
    assert (entry["label"], entry["num_classes"]) == ("score", 1)
    assert entry["probs"] == pytest.approx([one], rel=1e-5, abs=1e-6)
    assert classified["usage"]["prompt_tokens"] > len(ids)
    (raw,) = pooled["data"][0]["data"]  # the logit itself
    assert pooled["data"][0]["object"] == "pooling"
    assert 1.0 / (1.0 + math.exp(-raw)) == pytest.approx(one, rel=1e-5, abs=1e-6)
    assert refused.status_code == 400 and "sequence classifier" in refused.json()["error"][
        "message"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    assert [1.0 / (1.0 + math.exp(-x)) for x in raw_scores] == pytest.approx(
        want, rel=1e-5, abs=1e-6)
    assert raw_class["data"][0]["probs"] == pytest.approx([raw], rel=1e-5, abs=1e-6)
    assert not_pooling.status_code == 400 and not_pooling.json()["error"][
        "param"] == "use_activation"
