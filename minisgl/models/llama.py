"""The Llama family: Llama 2/3.x (incl. "llama3" rope scaling), SmolLM2 and SmolLM3, Mistral,
Mixtral."""

from types import MappingProxyType

from minisgl.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """Optional attention/MLP bias from the config; no q/k norm."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose every fourth layer (ModelConfig.rope_layers) rotates nothing
    (NoPE); with use_sliding_window those layers slide."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama decoder; its sliding window (every layer) is the attention
    backends' mask (ModelConfig.layer_windows)."""


class MixtralForCausalLM(MistralForCausalLM):
    """Mistral with every layer's MLP a mixture of experts. Its checkpoints name the block
    `block_sparse_moe` and an expert's gate, down and up projections w1, w2, w3."""

    checkpoint_renames = MappingProxyType({"block_sparse_moe": "mlp", "w1": "gate_proj",
                                           "w2": "down_proj", "w3": "up_proj"})
