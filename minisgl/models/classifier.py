"""Sequence classification models (rerankers, classifiers, reward models): which architectures
are served so, their labels, and how their logits become probabilities and scores.

A `*ForSequenceClassification` checkpoint is its family's decoder with a `score` head [labels,
hidden] (no bias) on the final norm's hidden state of the prompt's last token (transformers
pools the last non-padding token; minisgl runs every prompt unpadded). vLLM's conversion of a
causal LM into one (`hf_overrides`: `architectures` ["Qwen3ForSequenceClassification"],
`classifier_from_token` ["no", "yes"], `is_original_qwen3_reranker` or `method`
"from_2_way_softmax": Qwen3-Reranker's recipe) builds the head from the LM head's rows of those
tokens; the two-way form is one label, the second token's row minus the first's, whose sigmoid
is the softmax of the two tokens' logits.

Probabilities as vLLM's classify returns them: softmax over two or more labels, the sigmoid of
a single one; a pair's score (cross-encoder /score, /rerank) is the sigmoid of a one-label
logit; vLLM's `use_activation` (false: the logits themselves) and `logit_mean` /
`logit_sigma` (logits standardized first) as `LogitActivation`. Torch-free: the launcher and
the API server read it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

# *ForSequenceClassification -> the causal LM whose decoder it is
CLASSIFIER_BASES: Dict[str, str] = {
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",  # e.g. Skywork-Reward-Gemma-2
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
    "Glm4ForSequenceClassification": "Glm4ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "MixtralForSequenceClassification": "MixtralForCausalLM",
    "Phi3ForSequenceClassification": "Phi3ForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen2MoeForSequenceClassification": "Qwen2MoeForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
    "SmolLM3ForSequenceClassification": "SmolLM3ForCausalLM",
}


@dataclass(frozen=True)
class Classifier:
    """A model's classification head: `labels` its label names in order; `from_tokens` the
    tokens whose LM-head rows make it (none: the checkpoint's `score` tensor) and their ids
    (`token_ids`, read from the model's tokenizer.json); `two_way`: one label, the second
    token's row minus the first's."""

    labels: Tuple[str, ...]
    from_tokens: Tuple[str, ...] = ()
    token_ids: Tuple[int, ...] = ()
    two_way: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def parse_classifier(cfg: Dict[str, Any], declared: str) -> Optional[Classifier]:
    """The head config.json (with any overrides merged) describes for architecture
    `declared`; None for a causal LM. ValueError naming what does not fit."""
    if declared not in CLASSIFIER_BASES:
        return None
    tokens = tuple(str(t) for t in cfg.get("classifier_from_token") or ())
    two_way = bool(cfg.get("is_original_qwen3_reranker")
                   or cfg.get("method") == "from_2_way_softmax")
    if two_way and len(tokens) != 2:
        raise ValueError(f"a two-way classifier (is_original_qwen3_reranker / method "
                         f"from_2_way_softmax) takes two classifier_from_token, got "
                         f"{list(tokens)}")
    if tokens:
        labels = ("score",) if two_way else tokens
    else:
        id2label = cfg.get("id2label") or {}
        count = len(id2label) or int(cfg.get("num_labels") or 2)
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")))
                       for i in range(count))
    if not labels:
        raise ValueError(f"{declared} needs at least one label (id2label / num_labels)")
    return Classifier(labels, tokens, two_way=two_way)


def with_token_ids(classifier: Classifier, model_dir: Path) -> Classifier:
    """`classifier` with its tokens' ids from the model's tokenizer.json (nothing to do for a
    checkpoint's own head); ValueError naming a token the vocabulary lacks."""
    if not classifier.from_tokens:
        return classifier
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"classifier_from_token needs the model's tokenizer.json to find "
                         f"{list(classifier.from_tokens)}; {path} is missing")
    vocab = _vocabulary(json.loads(path.read_text()))
    missing = [t for t in classifier.from_tokens if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token {missing} not in {path}'s vocabulary")
    return replace(classifier, token_ids=tuple(vocab[t] for t in classifier.from_tokens))


def _vocabulary(tokenizer: Dict[str, Any]) -> Dict[str, int]:
    vocab = dict((tokenizer.get("model") or {}).get("vocab") or {})
    for added in tokenizer.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    return vocab


class LogitActivation(NamedTuple):
    """What a classifier's logits go through before they are answered as probabilities
    (classify) or a pair's score (a cross-encoder's), as vLLM's pooler_config and requests
    set it: (x - logit_mean) / logit_sigma, then, unless `use_activation` is False, the
    activation (`probabilities`, `sigmoid`). A reward model's logits (LLM.reward, /pooling)
    take none of this."""

    use_activation: bool = True
    logit_mean: float = 0.0
    logit_sigma: float = 1.0

    def for_request(self, use_activation: Optional[bool]) -> "LogitActivation":
        """This, with a request's `use_activation` where it sets one."""
        return self if use_activation is None else self._replace(use_activation=use_activation)

    def _scaled(self, logits: Sequence[float]) -> List[float]:
        return [(x - self.logit_mean) / self.logit_sigma for x in logits]

    def probabilities(self, logits: Sequence[float]) -> List[float]:
        """Classify's answer: each label's probability, or its scaled logit without the
        activation."""
        scaled = self._scaled(logits)
        return probabilities(scaled) if self.use_activation else scaled

    def score(self, logit: float) -> float:
        """A cross-encoder pair's score: the sigmoid of its scaled logit (or that logit)."""
        scaled = self._scaled([logit])[0]
        return sigmoid(scaled) if self.use_activation else scaled


def probabilities(logits: Sequence[float]) -> List[float]:
    """vLLM's classify activation: softmax over two or more labels, sigmoid of one."""
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def pair_score_error(classifier: Optional[Classifier]) -> Optional[str]:
    """Why a classifier cannot score pairs (a cross-encoder's score is one label's sigmoid),
    or None; None also for a model without a head (it scores by embeddings)."""
    if classifier is None or classifier.num_labels == 1:
        return None
    return (f"scoring pairs needs a one-label classifier (a cross-encoder or reranker); this "
            f"model has {classifier.num_labels} labels ({', '.join(classifier.labels)}): "
            f"use /classify")
