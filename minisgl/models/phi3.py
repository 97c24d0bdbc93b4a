"""The Phi-3 family (Phi-3 mini / small-free variants, Phi-3.5-mini, Phi-4): the Llama decoder,
whose checkpoints fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (rows in that
order, as Hugging Face's Phi3 splits them). Phi-4-mini's partial rotary embedding and the
128K variants' "longrope" scaling are refused at start-up (ModelConfig)."""

from types import MappingProxyType

from minisgl.models.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    """No biases, no q/k norm; a sliding window, where config.json sets one, caps the
    context (ModelConfig)."""

    checkpoint_fused = MappingProxyType({"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                         "gate_up_proj": ("gate_proj", "up_proj")})
