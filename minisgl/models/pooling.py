"""Whether a model's embeddings are the ones minisgl computes (its last token's final hidden
state, L2-normalized), as its sentence-transformers files say; and a Matryoshka model's
embeddings cut to fewer dimensions.

A sentence-transformers checkpoint lists its modules in `modules.json`; its Pooling module's
`config.json` names the pooling (`pooling_mode_lasttoken`, `..._mean_tokens`,
`..._cls_token`, ...). A model without those files is pooled by the last token, as vLLM
pools a decoder model by default. Any other pooling is refused where embeddings are asked for
(its vectors would differ from the model's), naming it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_LAST = "pooling_mode_lasttoken"


def pooling_refusal(model_dir: Path) -> Optional[str]:
    """Why this model's embeddings cannot be served (its pooling is not the last token's),
    or None."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        if pooling is None:
            return None
        config = json.loads((Path(model_dir) / pooling.get("path", "") / "config.json")
                            .read_text())
    except (OSError, ValueError, AttributeError) as e:
        return f"{modules_file} or its Pooling module's config.json cannot be read: {e}"
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in config.items()
                   if k.startswith("pooling_mode_") and v is True)
    if modes == [_LAST.removeprefix("pooling_mode_")]:
        return None
    return (f"this model's sentence-transformers pooling is {', '.join(modes) or 'none'}; "
            f"minisgl embeds by the last token only")


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


def shortened(values: Sequence[float], dimensions: Optional[int]) -> List[float]:
    """An embedding's first `dimensions` values, L2-normalized again (None: all of it, as
    it is)."""
    if dimensions is None:
        return list(values)
    head = list(values[:dimensions])
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
