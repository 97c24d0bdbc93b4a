"""EAGLE-3 draft heads for tests: random heads written in the published format, and the
reference greedy proposal they make (float32, CPU, recomputed from scratch).

The format is the one vLLM (`method: "eagle3"`) and SGLang (`EAGLE3`) load, as the published
heads (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, ...) ship it: a config.json naming
LlamaForCausalLMEagle3 and one safetensors file holding a single decoder layer `midlayer.*`
whose attention reads [embedding; hidden] (2H wide), the `fc` that folds the target's three
auxiliary hidden states (3H) into H, a final `norm`, a draft-vocabulary `lm_head` [D, H] and the
`d2t` / `t2d` maps between draft and target ids. There is no `embed_tokens`: the head uses the
target's.

`eagle3_drafts` is the specification a serving engine's EAGLE-3 proposer is tested against: its
drafts must equal these exactly (greedy), computed as vLLM computes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

_TARGETS: Dict[str, Any] = {}  # resolved target path -> transformers causal LM


def _target_model(target: Path) -> Any:
    """The HF causal LM at `target` in float32 on CPU, eval mode (loaded once per path)."""
    from transformers import AutoModelForCausalLM
    key = str(Path(target).resolve())
    if key not in _TARGETS:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        _TARGETS[key] = model.eval()
    return _TARGETS[key]


def default_aux_layers(num_hidden_layers: int) -> Tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 reads when the head's config names none: vLLM's
    and SGLang's default (2, n // 2, n - 3) for a target of n decoder layers. Only meaningful
    for n >= 4 (each id must lie in [0, n))."""
    n = num_hidden_layers
    return (2, n // 2, n - 3)


def write_eagle3(target: Path, out: Path, seed: int, draft_vocab: Optional[int] = None,
                 aux_layers: Optional[Sequence[int]] = None, scale: float = 0.1) -> Path:
    """Write a random EAGLE-3 head for the HF Llama/Qwen-style checkpoint dir `target` into
    `out` (created if missing) and return `out`.

    Files: `config.json` (LlamaForCausalLMEagle3; the target's hidden, intermediate, head and
    norm sizes, rope_theta; vocab_size V = the target's, draft_vocab_size D = `draft_vocab` or
    V; `eagle_aux_hidden_state_layer_ids` only when `aux_layers` is given) and
    `model.safetensors`, every tensor float32 except `d2t` (int64 [D]) and `t2d` (bool [V]).

    Weights are drawn, in the order listed in the body, from one generator seeded with `seed`:
    matrices N(0, 1) * `scale`, norm weights 1 + 0.1 * N(0, 1). `fc` is [H, a * H] with a =
    len(aux_layers) (3 when not given).

    Draft vocabulary: with D == V, d2t is zeros and t2d all True. With D < V, D distinct target
    ids (id 0 and D - 1 others drawn by a second generator seeded with `seed`), sorted
    ascending, are kept: d2t[i] = ids[i] - i (target id = i + d2t[i]) and t2d[ids] = True.
    """
    cfg = json.loads((Path(target) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or \
        cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    draft = vocab if draft_vocab is None else draft_vocab
    if not 1 <= draft <= vocab:
        raise ValueError(f"draft_vocab {draft} must lie in [1, {vocab}]")
    n_aux = 3 if aux_layers is None else len(aux_layers)
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:  # transformers 5 may keep it under rope_parameters
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    head_cfg: Dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": float(rope_theta),
        "max_position_embeddings": 2048, "vocab_size": vocab, "draft_vocab_size": draft,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
    if aux_layers is not None:
        head_cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in aux_layers]

    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors: Dict[str, torch.Tensor] = {
        "midlayer.self_attn.q_proj.weight": mat(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": mat(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": mat(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": mat(hidden, q),
        "midlayer.mlp.gate_proj.weight": mat(inter, hidden),
        "midlayer.mlp.up_proj.weight": mat(inter, hidden),
        "midlayer.mlp.down_proj.weight": mat(hidden, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "fc.weight": mat(hidden, n_aux * hidden),
        "lm_head.weight": mat(draft, hidden),
    }
    if draft == vocab:
        tensors["d2t"] = torch.zeros(draft, dtype=torch.int64)
        tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    else:
        pick = torch.Generator().manual_seed(seed)
        others = torch.randperm(vocab - 1, generator=pick)[:draft - 1] + 1
        zero = torch.zeros(1, dtype=torch.int64)
        ids = torch.cat([zero, others.to(torch.int64)]).sort().values
        tensors["d2t"] = ids - torch.arange(draft, dtype=torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _midlayer(w: Dict[str, torch.Tensor], cfg: dict, embeds: torch.Tensor,
              hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The head's decoder layer and final norm over a whole sequence, causal, no cache.

    `embeds`, `hidden`: [S, H] (the target's embedding of each input token, and each
    position's hidden input). Returns (normed, prenorm), both [S, H]: prenorm = the layer's
    output plus its residual (what the next draft step reads as its hidden input), normed =
    norm(prenorm) (what lm_head reads)."""
    eps = cfg["rms_norm_eps"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    seq = embeds.shape[0]
    p = "midlayer."

    residual = hidden
    x = torch.cat([_rms_norm(embeds, w[p + "input_layernorm.weight"], eps),
                   _rms_norm(hidden, w[p + "hidden_norm.weight"], eps)], dim=-1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(seq, heads, hd).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(seq, kv_heads, hd).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(seq, kv_heads, hd).transpose(0, 1)

    inv_freq = 1.0 / (float(cfg["rope_theta"]) **
                      (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)  # [S, hd]
    cos, sin = angles.cos(), angles.sin()
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin

    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(-1, -2)) / (hd ** 0.5)  # [heads, S, S]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    attn = torch.softmax(scores, dim=-1) @ v  # [heads, S, hd]
    attn = attn.transpose(0, 1).reshape(seq, heads * hd)
    h = attn @ w[p + "self_attn.o_proj.weight"].T + residual

    residual = h
    y = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    gate = y @ w[p + "mlp.gate_proj.weight"].T
    up = y @ w[p + "mlp.up_proj.weight"].T
    y = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    prenorm = y + residual
    return _rms_norm(prenorm, w["norm.weight"], eps), prenorm


def eagle3_drafts(target: Path, head: Path, tokens: Sequence[int], k: int) -> List[int]:
    """The `k` greedy draft tokens (target ids) the EAGLE-3 head at `head` proposes for the
    target at `target`, recomputed from scratch in float32 on CPU, as vLLM proposes them.

    `tokens` = t_0 .. t_P (P >= 1): the target has run t_0 .. t_{P-1}; t_P is the newest
    sampled token, not yet run through the target. `k` >= 1.

    1. The target runs t_0 .. t_{P-1}; position i's aux feature is the concatenation of the
       INPUTS of its decoder layers L_ids (HF hidden_states[l], index 0 = the embeddings),
       L_ids = the head config's eagle_aux_hidden_state_layer_ids, else (2, n // 2, n - 3).
       Each id must lie in [0, n).
    2. The draft sequence has position i (0 <= i < P) with hidden input fc(aux_i) and input
       token t_{i+1}; embeddings are the target's. The midlayer runs over it (rotary position =
       sequence index); draft 1 = i + d2t[i] for i = argmax of lm_head(normed) at position
       P - 1.
    3. For j = 1 .. k - 1: a position P - 1 + j is appended, with the previous last position's
       prenorm output as hidden input (no fc) and draft j as input token; the midlayer is
       recomputed over the whole sequence and draft j + 1 read at the new last position.
    """
    head = Path(head)
    cfg = json.loads((head / "config.json").read_text())
    tokens = [int(t) for t in tokens]
    n_prev = len(tokens) - 1  # P
    if n_prev < 1:
        raise ValueError("eagle3_drafts needs at least two tokens (P >= 1)")
    if k < 1:
        raise ValueError("k must be at least 1")
    w = load_file(str(head / "model.safetensors"))
    w = {name: (t if name in ("d2t", "t2d") else t.float()) for name, t in w.items()}
    d2t = w.get("d2t")

    model = _target_model(Path(target))
    n_layers = int(model.config.num_hidden_layers)
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    layer_ids = list(layer_ids) if layer_ids is not None else list(default_aux_layers(n_layers))
    if any(not 0 <= l < n_layers for l in layer_ids):
        raise ValueError(f"aux layer ids {layer_ids} must lie in [0, {n_layers}) "
                         f"(the target has {n_layers} decoder layers)")
    embed = model.get_input_embeddings()

    with torch.no_grad():
        out = model(torch.tensor([tokens[:n_prev]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[l][0].float() for l in layer_ids], dim=-1)  # [P, aH]
        hidden = aux @ w["fc.weight"].T  # [P, H]
        inputs = list(tokens[1:])  # t_1 .. t_P

        drafts: List[int] = []
        while True:
            embeds = embed(torch.tensor(inputs)).float()
            normed, prenorm = _midlayer(w, cfg, embeds, hidden)
            logits = normed[-1] @ w["lm_head.weight"].T  # [D]
            best = int(torch.argmax(logits))
            drafts.append(best + (int(d2t[best]) if d2t is not None else 0))
            if len(drafts) == k:
                return drafts
            hidden = torch.cat([hidden, prenorm[-1:]], dim=0)
            inputs.append(drafts[-1])


Proposal = Tuple[List[int], List[int]]  # (a request's tokens when it drafted, its drafts)


def record_proposals(monkeypatch: Any) -> List[Proposal]:
    """Every proposal the in-process engine's EAGLE-3 head makes from now on (pytest's
    `monkeypatch` wraps EagleDraft.propose), with the request's tokens it drafted after."""
    from minisgl.engine.eagle import EagleDraft
    seen: List[Proposal] = []
    propose = EagleDraft.propose

    def recorded(self: EagleDraft, batch: Any, adjust: Any) -> List[List[int]]:
        drafts = propose(self, batch, adjust)
        seen.extend((list(r.token_ids[:p + 1]), d)
                    for r, p, d in zip(batch.reqs, batch.prefix_lens, drafts))
        return drafts

    monkeypatch.setattr(EagleDraft, "propose", recorded)
    return seen


def reference_drafts(target: Path, head: Path, seen: Sequence[Proposal]) -> List[List[int]]:
    """`eagle3_drafts` for each recorded proposal's tokens and length (none: [])."""
    return [eagle3_drafts(target, head, ctx, len(d)) if d else [] for ctx, d in seen]

