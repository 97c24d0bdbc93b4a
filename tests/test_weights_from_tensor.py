"""Weights a trainer on the same machine hands over by reference (SGLang's
update_weights_from_tensor): offline at tp=1 and tp=2 and over HTTP, against Hugging Face's
tokens of the checkpoint sent; the payload's unpickler builds tensors and nothing else.

What must hold: each rank loads its shard of every tensor; updates in several buckets all
land; a tensor that is not a weight of the model is an error naming it, after which every rank
serves the checkpoint it loaded from disk; a payload that is no tensor list (or names any other
function) is refused before anything changes."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from typing import List

import pytest
import torch
from safetensors.torch import load_file

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM
from minisgl.distributed.tensor_payload import deserialize, serialize
from pushed_weights import greedy_tokens, push_case, sglang_bucket


class _Evil:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


def test_the_payload_holds_tensors_and_nothing_else() -> None:
    named = [("a.weight", torch.randn(3, 4)), ("b", torch.randn(4, 4).t())]
    back = deserialize(serialize(named))
    assert [n for n, _ in back] == ["a.weight", "b"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
    with pytest.raises(ValueError, match="names posix.system"):
        deserialize(pickle.dumps([("x", _Evil())]))
    with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
        deserialize(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a tensor payload"):
        deserialize(b"garbage")


def test_sglangs_flattened_bucket_opens_as_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's load_format="flattened_bucket": its bytes end to end and one
    FlattenedTensorMetadata a tensor (its class read as a plain record) come back as views of
    those bytes; a range that does not hold its tensor is refused with the numbers."""
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3))]
    bucket = sglang_bucket(named, monkeypatch)
    back = deserialize(serialize(bucket))
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(named, back))
    bucket["metadata"][1].end_idx += 2
    with pytest.raises(ValueError, match=r"entry b spans bytes \[48, 60\) of 106, for 10 bytes"):
        deserialize(serialize(bucket))
    with pytest.raises(ValueError, match="or a flattened bucket"):
        deserialize(serialize({"flattened_tensor": torch.zeros(4)}))


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_weights_from_tensors(two_llamas: List[Path], tp: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    case = push_case(two_llamas)
    tensors, names = case.tensors, case.names
    with LLM(str(case.served), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        half = len(names) // 2  # a trainer's buckets: pairs, then SGLang's flattened bucket
        llm.update_weights_from_tensor([(n, tensors[n]) for n in names[:half]])
        llm.update_weights_from_tensor(
            sglang_bucket([(n, tensors[n]) for n in names[half:]], monkeypatch),
            load_format="flattened_bucket")
        assert greedy_tokens(llm, case.prompts) == case.want_pushed
        with pytest.raises(ValueError, match="nothing"):
            llm.update_weights_from_tensor([(names[0], tensors[names[0]]),
                                            ("model.layers.0.mlp.nothing.weight",
                                             torch.zeros(2, 3))])
        assert greedy_tokens(llm, case.prompts) == case.want_served  # from disk again
        with pytest.raises(ValueError, match="load_format 'tensor_dict'"):
            llm.update_weights_from_tensor([], load_format="tensor_dict")
        assert llm.check_accounting().live_requests == 0


def _push_then_generate(url: str, payload: str, prompts: List[List[int]], new_tokens: int,
                        **body: object) -> List[dict]:
    """POST the payload to /update_weights_from_tensor (it must succeed), then each prompt's
    greedy /generate reply."""
    import httpx
    r = httpx.post(f"{url}/update_weights_from_tensor",
                   json={"serialized_named_tensors": [payload], **body}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    return [httpx.post(f"{url}/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                 "ignore_eos": True}}, timeout=60).json()
            for prompt in prompts]


def test_served_weights_from_tensors(two_llamas: List[Path], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's body and answers over HTTP (the tensors in shared memory by file name: the
    server's ranks are no children of this process), as pairs and as a flattened bucket (the
    served checkpoint's own tensors back); bad bodies are 400s naming why."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    a, b = two_llamas
    prompts = mixed_prompts(2, seed=38, lengths=(6, 19))
    want_b = hf_greedy(b, prompts, 8)
    tensors = load_file(str(b / "model.safetensors"))
    payload = base64.b64encode(serialize(sorted(tensors.items()))).decode()
    with serving(["--model", str(a), *CPU_ARGS], tmp_path) as srv:
        url = f"{srv.url}/update_weights_from_tensor"
        outs = _push_then_generate(srv.url, payload, prompts, 8, weight_version="step-1")
        assert [o["output_ids"] for o in outs] == want_b
        assert all(o["meta_info"]["weight_version"] == "step-1" for o in outs)
        bucket = sglang_bucket(sorted(load_file(str(a / "model.safetensors")).items()),
                               monkeypatch)
        outs = _push_then_generate(srv.url, base64.b64encode(serialize(bucket)).decode(),
                                   prompts, 8, load_format="flattened_bucket")
        assert [o["output_ids"] for o in outs] == hf_greedy(a, prompts, 8)
        evil = base64.b64encode(pickle.dumps([("x", _Evil())])).decode()
        for body, words in (({"serialized_named_tensors": [evil]}, "posix.system"),
                            ({"serialized_named_tensors": ["%%%"]}, "base64"),
                            ({"serialized_named_tensors": [payload, payload]}, "2 payloads"),
                            ({"serialized_named_tensors": []}, "0 payloads"),
                            ({"serialized_named_tensors": [payload],
                              "load_format": "tensor_dict"}, "load_format")):
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 400 and not r.json()["success"], r.text
            assert words in r.json()["message"], r.text


@pytest.mark.gpu
def test_gpu_weights_from_cuda_tensors_by_ipc(two_llamas: List[Path], tmp_path: Path) -> None:
    """A CUDA engine served in other processes maps this process's CUDA tensors by their IPC
    handles (float32: the CPU's tokens of the checkpoint sent)."""
    from server_helpers import serving
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    a, b = two_llamas
    prompts = mixed_prompts(2, seed=39, lengths=(6, 19))
    with LLM(str(b), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False) as llm:
        want = greedy_tokens(llm, prompts)
    tensors = {n: t.cuda() for n, t in load_file(str(b / "model.safetensors")).items()}
    payload = base64.b64encode(serialize(sorted(tensors.items()))).decode()
    with serving(["--model", str(a), "--device", "cuda", "--dtype", "float32",
                  "--max-kv-tokens", "4096", "--log-level", "warning"], tmp_path) as srv:
        outs = _push_then_generate(srv.url, payload, prompts, 10)
    assert [o["output_ids"] for o in outs] == want
