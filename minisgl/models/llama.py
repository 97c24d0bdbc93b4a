"""The Llama family: Llama 2/3.x (incl. "llama3" rope scaling), SmolLM2 and SmolLM3, Granite,
Mistral, Mixtral."""

from types import MappingProxyType

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import MULTIMODAL_TEXT_PREFIXES, CausalLM, Traits


class LlamaForCausalLM(CausalLM):
    """Optional attention/MLP bias from the config; no q/k norm."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose every fourth layer (ModelConfig.rope_layers) rotates nothing
    (NoPE); with use_sliding_window those layers slide."""


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x: the Llama decoder with four multipliers (ModelConfig): the embeddings'
    (as given, not rounded to the dtype as Gemma's), the attention's scale, the logits'
    divisor (the LM head's), and each sublayer's output's, folded into o_proj and down_proj
    as they load (and into LoRA adapters' B of those)."""

    @classmethod
    def traits(cls, cfg: ModelConfig) -> Traits:
        return super().traits(cfg)._replace(embed_scale=cfg.embedding_multiplier,
                                            embed_scale_rounded=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama decoder; its sliding window (every layer) is the attention
    backends' mask (ModelConfig.layer_windows)."""


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral-Small-3.1 / 3.2 (and Devstral's, Magistral's multimodal checkpoints): their text
    decoder, a Mistral one. Its tensors are `language_model.model.*` as published (and as
    transformers saves them), `model.language_model.*` in transformers 5's own layout; the
    vision tower and projector are not served (text prompts only)."""

    checkpoint_prefixes = MULTIMODAL_TEXT_PREFIXES


class MixtralForCausalLM(MistralForCausalLM):
    """Mistral with every layer's MLP a mixture of experts. Its checkpoints name the block
    `block_sparse_moe` and an expert's gate, down and up projections w1, w2, w3."""

    checkpoint_renames = MappingProxyType({"block_sparse_moe": "mlp", "w1": "gate_proj",
                                           "w2": "down_proj", "w3": "up_proj"})
