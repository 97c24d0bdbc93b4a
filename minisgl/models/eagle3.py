"""EAGLE-3 draft heads (vLLM's speculative method "eagle3", SGLang's EAGLE3; the checkpoints of
EAGLE's authors, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, and SpecForge's): one Llama decoder
layer that drafts from the target's own hidden states (engine/eagle.py runs it).

At sequence position i the head takes g_i, the target's hidden states at the input of three of
its layers fused by `fc` (or, past the target's last position, the head's own state before its
final norm at i - 1), and the embedding of the token after i; it predicts the token after that:

    residual = g;  x = [input_layernorm(embed(token)), hidden_norm(g)]   (2 x hidden)
    h = o_proj(attention(x)) + residual;  s = mlp(post_attention_layernorm(h)) + h
    normed = norm(s): the LM head's input;  s: the next step's g

Its LM head scores the draft vocabulary; d2t maps draft token i to target token i + d2t[i].
Embeddings are the checkpoint's where it has them, else the target's (`share_embeddings`;
Eagle3Shape.shares_embeddings says which before it is built). Its K/V (one layer) live in a
pool of its own.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Optional, Tuple, cast

import torch
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.distributed import Communicator, DistributedInfo
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.linear import ReplicatedLinear, ResidualStream
from minisgl.layers.norm import Normed
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.layers.source import TensorSource, copy_into
from minisgl.models.config import Eagle3Shape, ModelConfig
from minisgl.models.decoder import MLP, Attention, CausalLM, LocalHeads, Traits


def eagle_shape(cfg: ModelConfig) -> Eagle3Shape:
    """cfg's EAGLE-3 shape; ValueError where cfg is not an EAGLE-3 head's."""
    if cfg.eagle is None:
        raise ValueError(f"{cfg.architecture} is not an EAGLE-3 head")
    return cfg.eagle


class DraftVocab(nn.Module):
    """d2t [draft vocabulary]: draft token i is target token i + d2t[i] (zeros where the
    checkpoint gives none: the draft vocabulary is the target's first tokens, or all)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.int64))
        self.loaded = False  # whether a checkpoint gave d2t

    def load(self, param: str, src: TensorSource, shard_id: int = 0) -> None:
        copy_into(cast(torch.Tensor, self.d2t), src.read().to(torch.int64), "d2t")
        self.loaded = True

    def target_ids(self) -> torch.Tensor:
        """[draft vocabulary]: each draft token's target token."""
        d2t = cast(torch.Tensor, self.d2t)
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (the module doc's formula, but the final norm)."""

    def __init__(self, cfg: ModelConfig, traits: Traits, rotary: RotaryEmbedding,
                 info: DistributedInfo, comm: Communicator) -> None:
        super().__init__()
        norm = lambda: traits.norm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.hidden_norm = norm(), norm()
        self.self_attn = Attention(cfg, 0, traits, rotary, info, comm, 2 * cfg.hidden_size)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg, info, comm, traits, "model.layers.0.mlp")

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend) -> ResidualStream:
        x = torch.cat([cast(torch.Tensor, self.input_layernorm(embeds)),
                       cast(torch.Tensor, self.hidden_norm(features))], dim=-1)
        stream = self.self_attn.forward_input(x, features, positions, batch, backend)
        return self.mlp(stream, self.post_attention_layernorm)


class Eagle3Decoder(nn.Module):
    """The head under its LM head: embeddings (or the target's), `fc`, the layer, the norm."""

    def __init__(self, cfg: ModelConfig, traits: Traits, info: DistributedInfo,
                 comm: Communicator) -> None:
        super().__init__()
        shape = eagle_shape(cfg)
        self.embed_tokens = (None if shape.shares_embeddings else
                             VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, info, comm))
        self._shared: Tuple[VocabParallelEmbedding, ...] = ()  # the target's (not its own)
        self.fc = ReplicatedLinear(shape.features * shape.target_hidden, cfg.hidden_size, False,
                                   traits.policy)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.rope_theta, cfg.rope_scaling,
                                 traits.policy, cfg.max_position_embeddings, cfg.rotary_dims)
        self.rope_index = rotary.index
        layer = Eagle3Layer(cfg, traits, rotary, info, comm)
        self.layers = nn.ModuleList([layer])
        qkv = layer.self_attn.qkv_proj
        self.local_heads = LocalHeads(qkv.num_local_kv_heads, qkv.num_local_heads)
        self.norm = traits.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.embed_tokens if self.embed_tokens is not None else self._shared[0]
        return embeddings(ids)


class LlamaForCausalLMEagle3(CausalLM):
    """An EAGLE-3 head (module doc). Its checkpoints name the layer `midlayer`, and `fc`, `d2t`
    and `t2d` (the inverse map, not read) at the top level. It runs through `step`, never
    through `forward` or `hidden` (it needs the target's hidden states)."""

    checkpoint_prefixes = MappingProxyType({"midlayer.": "model.layers.0.", "fc.": "model.fc.",
                                            "d2t": "draft_vocab.d2t", "t2d": None})

    def __init__(self, cfg: ModelConfig, info: DistributedInfo, comm: Communicator,
                 *args: Any, **kw: Any) -> None:
        super().__init__(cfg, info, comm, *args, **kw)
        self.draft_vocab = DraftVocab(cfg.lm_head_rows)

    @classmethod
    def _decoder(cls, cfg: ModelConfig, traits: Traits, info: DistributedInfo,
                 comm: Communicator) -> Eagle3Decoder:
        return Eagle3Decoder(cfg, traits, info, comm)

    def share_embeddings(self, embeddings: VocabParallelEmbedding) -> None:
        """Embed with the target's `embeddings` (a head built with shares_embeddings)."""
        self.model._shared = (embeddings,)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g [T, hidden] from the target's kept hidden states [T, features x target hidden]."""
        return cast(torch.Tensor, self.model.fc(aux))

    def step(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             batch: Batch, backend: AttentionBackend) -> Normed:
        """The head over `batch`'s tokens: (normed, s) per row, from each row's input token
        `ids` (the token after its position) and its `features` g; writes the K/V of its
        positions at the batch's slots."""
        stream = self.model.layers[0](self.model.embed(ids), features, positions, batch,
                                      backend)
        return stream.normed(self.model.norm)

    def target_logits(self, normed: torch.Tensor, target_ids: torch.Tensor,
                      target_vocab: int) -> torch.Tensor:
        """float32 [rows, target_vocab] logits: the draft vocabulary's at their target
        tokens (`target_ids`: DraftVocab.target_ids), -inf at the others (so the target's
        sampling reads them)."""
        draft = self.lm_head(normed).float()
        out = draft.new_full((draft.shape[0], target_vocab), float("-inf"))
        out[:, target_ids] = draft
        return out

    def hidden(self, *args: Any, **kw: Any) -> torch.Tensor:
        raise TypeError("an EAGLE-3 head runs through step(), with the target's hidden states")

    def forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        raise TypeError("an EAGLE-3 head runs through step(), with the target's hidden states")


class Eagle3LlamaForCausalLM(LlamaForCausalLMEagle3):
    """vLLM's name for the same head."""


def check_draft_vocab(model: LlamaForCausalLMEagle3, target_vocab: int, name: str,
                      dummy: bool = False) -> Optional[str]:
    """Why `model`'s draft vocabulary cannot map onto a target of `target_vocab` tokens
    (ValueError's text; None: it can). `dummy`: random weights, whose d2t is zeros."""
    draft = model.cfg.lm_head_rows
    if draft > target_vocab:
        return f"{name} drafts {draft} tokens, more than the target's {target_vocab}"
    if draft < target_vocab and not model.draft_vocab.loaded and not dummy:
        return (f"{name} drafts {draft} of the target's {target_vocab} tokens but its "
                f"checkpoint has no d2t (which says which)")
    ids = model.draft_vocab.target_ids()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab):
        return f"{name}'s d2t maps draft tokens outside the target's {target_vocab} tokens"
    return None
