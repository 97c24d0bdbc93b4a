"""The Phi-3 family as Phi3ForCausalLM serves it (Phi-3 mini and medium 4K and 128K, Phi-3.5,
Phi-4, Phi-4-mini): the Llama decoder, whose checkpoints fuse q/k/v into `qkv_proj` and gate/up
into `gate_up_proj` (rows in that order, as Hugging Face's Phi3 splits them). The 128K
variants' "longrope" scaling and Phi-4-mini's partial rotary embedding are the rotary layer's
(layers/rotary.py, ModelConfig)."""

from types import MappingProxyType

from minisgl.models.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    """No biases, no q/k norm; a sliding window where config.json sets one (every layer; the
    attention backends mask it, ModelConfig.layer_windows)."""

    checkpoint_fused = MappingProxyType({"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                         "gate_up_proj": ("gate_proj", "up_proj")})
