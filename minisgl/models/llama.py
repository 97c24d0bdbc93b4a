"""The Llama family: Llama 2/3.x (incl. "llama3" rope scaling), SmolLM2, Mistral."""

from minisgl.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """Optional attention/MLP bias from the config; no q/k norm."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama decoder; a sliding window caps the context (see ModelConfig)."""
