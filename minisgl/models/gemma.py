"""The Gemma family: Gemma 2, and Gemma 3's text decoder (Gemma3ForCausalLM, the 1B
checkpoints, and the multimodal Gemma3ForConditionalGeneration checkpoints, 4B, 12B, 27B, whose
vision tower and projector are not loaded: text prompts only).

The decoder's differences (decoder.py's traits): embeddings scaled by sqrt(hidden_size),
RMSNorms that multiply by 1 + weight, norms after attention and the MLP as well as before them,
GELU (tanh) in the MLP; Gemma 3 adds per-head q/k norms. The config's (ModelConfig): the
attention scale of `query_pre_attn_scalar`, sliding-window layers (Gemma 2: every other one;
Gemma 3: five to one full, with their own unscaled rope theta), and Gemma 2's tanh
softcapping of the attention scores and of the logits.
"""

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import MULTIMODAL_TEXT_PREFIXES, CausalLM, Traits


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: the Gemma decoder without q/k norms (its softcaps are the config's)."""

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Traits(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=False,
                      norm_offset=1.0, embed_scale=cfg.hidden_size ** 0.5, sandwich_norms=True)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder: Gemma 2's with per-head q/k norms."""

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return Gemma2ForCausalLM.traits(cfg)._replace(qk_norm=True)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model's tensors are `language_model.model.*` in the published checkpoints
    (transformers 4) and `model.language_model.*` as transformers 5 saves them."""

    checkpoint_prefixes = MULTIMODAL_TEXT_PREFIXES
