"""How a model's embeddings pool its final hidden states, as its sentence-transformers files
(or vLLM's --pooler-config) say; and a Matryoshka model's embeddings cut to fewer dimensions.

A sentence-transformers checkpoint lists its modules in `modules.json`; its Pooling module's
`config.json` names the pooling (`pooling_mode_lasttoken`, `..._mean_tokens`,
`..._cls_token`, ...). A model without those files is pooled by the last token, as vLLM
pools a decoder model by default. The last token's, the mean and the first (CLS) token's are
served (core.POOLINGS); any other pooling (max, weighted mean, several at once) is refused where
embeddings are asked for (its vectors would differ from the model's), naming it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from minisgl.models.classifier import LogitActivation
from minisgl.settings import json_object


_POOLING_MODULE = "sentence_transformers.models.Pooling"
# sentence-transformers' pooling modes (and vLLM's pooling types) -> ours
_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}
_VLLM_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}


class Pooling(NamedTuple):
    """A model's pooling for embeddings: `mode`, one of core.POOLINGS; `normalize`: its
    embeddings L2-normalized (the default; a request may say otherwise); `refusal`: why its
    embeddings cannot be served (its pooling is none of those), or None; `dimensions`: the
    length a Matryoshka model's embeddings are cut to where a request names none (None:
    whole); `logits`: what a classifier's logits go through (classifier.LogitActivation)."""

    mode: str = "last"
    refusal: Optional[str] = None
    normalize: bool = True
    dimensions: Optional[int] = None
    logits: LogitActivation = LogitActivation()  # a classifier's (pooler_config's)

    def cut_to(self, requested: Optional[int]) -> Optional[int]:
        """The length a request's embeddings are cut to: its own `dimensions`, else the
        model's default (None: whole)."""
        return self.dimensions if requested is None else requested


class PoolerChoice(NamedTuple):
    """What --pooler-config sets (None: the model's own)."""

    mode: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    logits: LogitActivation = LogitActivation()


# vLLM's names of the classify activation switch: `use_activation`, and the older `activation`
# and `softmax` it still reads
_ACTIVATION_KEYS = ("use_activation", "activation", "softmax")
_KEYS = ("pooling_type", "normalize", "dimensions", *_ACTIVATION_KEYS, "logit_mean",
         "logit_sigma")


def parse_pooler_config(text: Optional[str]) -> PoolerChoice:
    """vLLM's --pooler-config JSON (`{"pooling_type": "MEAN", "normalize": false}`) -> our
    pooling mode, normalization, embedding length and classify settings (`use_activation`,
    or its older names `activation` / `softmax`; `logit_mean`, `logit_sigma`); ValueError
    naming a field or value minisgl does not take."""
    if text is None:
        return PoolerChoice()
    config = json_object(text, "pooler_config", keys=_KEYS)
    kind = config.get("pooling_type")
    if kind is not None and (not isinstance(kind, str) or kind.upper() not in _VLLM_TYPES):
        raise ValueError(f"pooler_config: pooling_type must be one of "
                         f"{', '.join(_VLLM_TYPES)}, got {kind!r:.40}")
    normalize = config.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got "
                         f"{normalize!r:.40}")
    dims = config.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"pooler_config: dimensions must be a positive integer, got "
                         f"{dims!r:.40}")
    return PoolerChoice(None if kind is None else _VLLM_TYPES[kind.upper()], normalize, dims,
                        _logit_activation(config))


def _logit_activation(config: Dict[str, Any]) -> LogitActivation:
    """pooler_config's classify settings; ValueError naming a value of the wrong kind, a
    logit_sigma not above 0, or activation switches that disagree."""
    switches = {key: config[key] for key in _ACTIVATION_KEYS if config.get(key) is not None}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"pooler_config: {key} must be true or false, got {value!r:.40}")
    if len(set(switches.values())) > 1:
        raise ValueError(f"pooler_config: {' and '.join(switches)} disagree")
    numbers = {}
    for key, default in (("logit_mean", 0.0), ("logit_sigma", 1.0)):
        value = config.get(key, default)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise ValueError(f"pooler_config: {key} must be a finite number, got {value!r:.40}")
        numbers[key] = float(value)
    if numbers["logit_sigma"] <= 0:
        raise ValueError(f"pooler_config: logit_sigma must be above 0, got "
                         f"{numbers['logit_sigma']}")
    return LogitActivation(next(iter(switches.values()), True), numbers["logit_mean"],
                           numbers["logit_sigma"])


def model_pooling(model_dir: Path, pooler_config: Optional[str] = None) -> Pooling:
    """The pooling of the model at `model_dir`: `pooler_config`'s type where given
    (parse_pooler_config), else its sentence-transformers Pooling module's, else the last
    token's; normalized unless `pooler_config` says not; cut to its `dimensions` where given
    (check_pooler_dimensions checks them against the model); a classifier's logits as its
    `use_activation`, `logit_mean` and `logit_sigma` say."""
    chosen = parse_pooler_config(pooler_config)
    pooling = _files_pooling(model_dir) if chosen.mode is None else Pooling(chosen.mode)
    pooling = pooling._replace(dimensions=chosen.dimensions, logits=chosen.logits)
    return pooling if chosen.normalize is None else pooling._replace(normalize=chosen.normalize)


def check_pooler_dimensions(pooler_config: Optional[str], allowed: Optional[Tuple[int, ...]],
                            hidden_size: int) -> None:
    """ValueError (at start-up) where pooler_config's `dimensions` is not a length the model's
    embeddings may be cut to (dimensions_error)."""
    dims = parse_pooler_config(pooler_config).dimensions
    error = None if dims is None else dimensions_error(dims, allowed, hidden_size)
    if error is not None:
        raise ValueError(f"pooler_config: {error}")


def _files_pooling(model_dir: Path) -> Pooling:
    """The pooling model_dir's sentence-transformers files give (none: the last token's)."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
        module = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        if module is None:
            return Pooling()
        config = json.loads((Path(model_dir) / module.get("path", "") / "config.json")
                            .read_text())
    except (OSError, ValueError, AttributeError) as e:
        return Pooling(refusal=f"{modules_file} or its Pooling module's config.json cannot "
                               f"be read: {e}")
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in config.items()
                   if k.startswith("pooling_mode_") and v is True)
    if len(modes) == 1 and modes[0] in _ST_MODES:
        return Pooling(_ST_MODES[modes[0]])
    return Pooling(refusal=f"this model's sentence-transformers pooling is "
                           f"{', '.join(modes) or 'none'}; minisgl pools by "
                           f"{', '.join(_ST_MODES)} (one of them)")


def dimensions_error(dimensions: int, allowed: Optional[Tuple[int, ...]],
                     hidden_size: int) -> Optional[str]:
    """Why an embedding cannot be cut to `dimensions` (vLLM's Matryoshka check): a model not
    trained for it (`allowed` None: ModelConfig.matryoshka_dimensions), a length it does not
    list, or one outside [1, hidden_size]; None where it can."""
    if allowed is None:
        return (f"dimensions {dimensions}: this model's embeddings cannot be shortened (not a "
                f"Matryoshka model; --hf-overrides '{{\"is_matryoshka\": true}}' says it is)")
    if not 1 <= dimensions <= hidden_size or (allowed and dimensions not in allowed):
        listed = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
        return f"dimensions {dimensions}: this model's embeddings may be cut to {listed}"
    return None


def shortened(values: Sequence[float], dimensions: Optional[int], normalize: bool = True
              ) -> List[float]:
    """An embedding's first `dimensions` values, L2-normalized again where `normalize` (None:
    all of it, as it is)."""
    if dimensions is None:
        return list(values)
    head = list(values[:dimensions])
    if not normalize:
        return head
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def paired_texts(text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]]
                 ) -> Tuple[List[str], List[str]]:
    """vLLM's score pairs: one text_1 with each text_2, or two lists of one length in order;
    ValueError naming the counts otherwise (or where either is empty)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if not seconds or len(firsts) != len(seconds):
        raise ValueError(f"score pairs one text_1 with each text_2, or two lists of one "
                         f"length; got {len(firsts)} and {len(seconds)} texts")
    return firsts, seconds
