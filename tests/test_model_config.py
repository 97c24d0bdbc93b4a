"""The context length and rope scaling read from config.json, as vLLM reads them: YaRN and
linear scaling stretch it, a used sliding window cuts it, an unimplemented scaling is refused
naming its type. (Numerics of every scaling against Hugging Face: test_engine_hf.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig

QWEN3_8B = json.loads((Path(__file__).resolve().parent.parent / "configs" / "models" / "qwen3-8b"
                       / "config.json").read_text())


def _config(**changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**QWEN3_8B, **changes})


def test_yarn_stretches_the_context_as_qwen_documents() -> None:
    """Qwen3's model card: factor 4 over 32768 pretraining positions serves 131072."""
    cfg = _config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768})
    assert cfg.max_context == 131072 and cfg.max_position_embeddings == 40960
    assert _config().max_context == 40960


@pytest.mark.parametrize("changes,context", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, 81920),  # the older key, `type`
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 0.5,
                                                "rope_theta": 1e6}}, 20480),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 81920),  # trained: max_position
    ({"sliding_window": 4096, "use_sliding_window": True}, 4096),
    ({"sliding_window": 4096, "use_sliding_window": False}, 40960),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 40960),
])
def test_context_length(changes: Dict[str, Any], context: int) -> None:
    assert _config(**changes).max_context == context


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope scaling type 'dynamic'"),
    ({"type": "longrope", "factor": 2.0}, "unsupported rope scaling type 'longrope'"),
    ({"rope_type": "yarn", "factor": -1.0}, "rope scaling factor must be > 0"),
])
def test_unimplemented_or_bad_scaling_is_refused(scaling: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(rope_scaling=scaling)


def test_yarn_tables_carry_the_attention_factor() -> None:
    """cos and sin are scaled by 0.1 ln(factor) + 1 (both, so q.k gains its square), and the
    highest frequencies are kept as trained while the lowest are interpolated."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = RotaryEmbedding(32, 128, 10000.0, None)
    yarn = RotaryEmbedding(32, 128, 10000.0, scaling)
    attention = 0.1 * torch.log(torch.tensor(4.0)).item() + 1
    assert torch.allclose(yarn.cos[0], torch.full((32,), attention))
    angle = torch.atan2(yarn.sin[1], yarn.cos[1])  # position 1: the inverse frequencies
    assert torch.allclose(angle[0], torch.atan2(plain.sin[1], plain.cos[1])[0])
    assert torch.allclose(angle[15], torch.atan2(plain.sin[1], plain.cos[1])[15] / 4)
