#!/usr/bin/env python3
"""How far FP8 weights move a model: teacher-forced next-token distributions over real text.

One engine runs the model as it is (the reference), one with `--quantization fp8` (or an FP8
checkpoint of the same model, `--fp8-model`); both read the same text (default: the opening
of Dickens' A Tale of Two Cities, public domain, scripts/data/two_cities.txt) in one prefill,
and at every position the script compares the two next-token distributions:
KL(reference || fp8) (mean, median, max, in nats), the greedy agreement (argmax equal), and
each one's perplexity on the text. On the CPU FP8 is weight-only (the weights dequantized at
load); on CUDA the projections are W8A8 (layers/fp8.py).

    PYTHONPATH=. python scripts/fp8_accuracy.py                      # default model, CPU
    PYTHONPATH=. python scripts/fp8_accuracy.py --device cuda --dtype bfloat16

Prints a summary and one line of JSON (prefixed "RESULT ").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Optional

import torch

from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.distributed import destroy_process_groups, init_process_groups
from minisgl.engine import Engine, EngineConfig
from minisgl.models.path import resolve_model_path
from minisgl.tokenizer.text import load_tokenizer
from minisgl.distributed.bind import free_port
from minisgl.utils import to_device

TEXT = Path(__file__).parent / "data" / "two_cities.txt"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or hub id (default: the "
                                                 "bundled default model)")
    p.add_argument("--fp8-model", default=None, help="an FP8 checkpoint of the same model to "
                                                     "compare instead of --quantization fp8")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, "
                                                 "bfloat16 on CUDA)")
    p.add_argument("--text", type=Path, default=TEXT, help="a plain-text file to read")
    p.add_argument("--max-tokens", type=int, default=1024, help="read at most this many "
                                                                "tokens of the text")
    return p.parse_args(argv)


def text_logits(engine: Engine, ids: List[int]) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one prefill over `ids` (row i predicts ids[i + 1]),
    in page-table row 0 and KV slots 0.. of the engine's pool."""
    n = len(ids)
    dev = engine.device
    req = Req(0, list(ids), n, SamplingParams(max_tokens=1, temperature=0.0), (), table_row=0)
    engine.page_table[0, :n] = torch.arange(n, dtype=torch.int32, device=dev)
    batch = Batch(Phase.PREFILL, [req], [0], [n], [True])
    batch.out_slots = torch.arange(n, dtype=torch.int64, device=dev)
    # The model's inputs, as Engine._prepare_inputs makes them (no longer Batch fields).
    input_ids = to_device(ids, torch.int64, dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    with torch.inference_mode():
        engine.backend.prepare(batch)
        hidden = engine.model.hidden(input_ids, positions, batch, engine.backend)
        return engine.model.lm_head(hidden).float()[:, :engine.vocab_size]


def run_engine(cfg: EngineConfig, model_path: str, ids: List[int]) -> torch.Tensor:
    """Logits of `ids` from a fresh tp=1 engine of `cfg` (on the host afterwards)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    rank_cfg = cfg.for_rank(model_path, 0, init)
    groups = init_process_groups(rank_cfg.tp_info, rank_cfg.torch_device, init,
                                 rank_cfg.dist_timeout_s, rank_cfg.allreduce)
    try:
        engine = Engine(rank_cfg, groups)
        logits = text_logits(engine, ids).cpu()
        del engine
        if rank_cfg.torch_device.type == "cuda":
            torch.cuda.empty_cache()
        return logits
    finally:
        destroy_process_groups()


def compare(ref: torch.Tensor, fp8: torch.Tensor, ids: List[int]) -> Dict[str, float]:
    """KL(ref || fp8) per position, greedy agreement and both perplexities on ids[1:]."""
    logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(fp8, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)[:-1]
    target = torch.tensor(ids[1:])
    nll = lambda lp: -lp[:-1].gather(1, target[:, None]).mean().item()  # noqa: E731
    return {"positions": int(kl.numel()), "kl_mean": kl.mean().item(),
            "kl_median": kl.median().item(), "kl_max": kl.max().item(),
            "greedy_agreement": (ref.argmax(-1) == fp8.argmax(-1))[:-1].float().mean().item(),
            "ppl_reference": float(torch.exp(torch.tensor(nll(logp)))),
            "ppl_fp8": float(torch.exp(torch.tensor(nll(logq))))}


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    model_path = str(resolve_model_path(args.model))
    tokenizer = load_tokenizer(Path(model_path))
    if tokenizer is None:
        raise SystemExit(f"{model_path} has no tokenizer files, so the text cannot be read: "
                         "measure a model directory with its tokenizer")
    ids = tokenizer.encode(args.text.read_text(), add_special_tokens=False)[:args.max_tokens]
    base = EngineConfig(device=args.device, dtype=args.dtype, max_kv_tokens=len(ids) + 64,
                        max_running_requests=1, cuda_graph_max_bs=0, show_progress=False)
    ref = run_engine(base, model_path, ids)
    if args.fp8_model is not None:
        fp8 = run_engine(base, str(resolve_model_path(args.fp8_model)), ids)
    else:
        fp8 = run_engine(dataclasses.replace(base, quantization="fp8"), model_path, ids)
    result = compare(ref, fp8, ids)
    how = "weight-only" if args.device == "cpu" else "W8A8"
    print(f"{Path(model_path).name}: FP8 ({args.fp8_model or 'online'}, {how}) against "
          f"{base.torch_dtype} over {result['positions']} positions of {args.text.name}:")
    print(f"  KL(ref || fp8) mean {result['kl_mean']:.5f}, median {result['kl_median']:.5f}, "
          f"max {result['kl_max']:.4f} nats; greedy agreement "
          f"{100 * result['greedy_agreement']:.1f}%; perplexity {result['ppl_reference']:.3f} "
          f"-> {result['ppl_fp8']:.3f}")
    print("RESULT " + json.dumps({"model": Path(model_path).name, "device": args.device,
                                  "dtype": str(base.torch_dtype), "fp8": args.fp8_model or
                                  "online", "text": args.text.name,
                                  **{k: round(v, 6) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
