"""Weights pushed by a trainer over a process group (SGLang's init_weights_update_group /
update_weights_from_distributed / destroy_weights_update_group): offline at tp=1 and tp=2 and
over HTTP, with a gloo trainer in this process (rank 0: it hosts the TCP store and broadcasts,
as an RL trainer does) and Hugging Face's tokens of the checkpoint it sends.

What must hold: the ranks join the trainer's group and receive each tensor whole, keeping their
shard; weights sent in buckets all land; a tensor that is not a weight of the model is an error
naming it, after every tensor of the update was still received (the trainer never hangs), and
every rank serves the checkpoint it loaded from disk; a bad group is refused before anyone
waits on it.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM
from minisgl.distributed.bind import free_port
from pushed_weights import greedy_tokens, push_case

GROUP = "weight_update_group"


class Trainer:
    """Rank 0 of a weight update group on gloo, as a trainer makes it (the key layout of
    torch's new_group: distributed/weight_group.py); joining and each broadcast run on a
    thread, since they wait for the service's ranks."""

    def __init__(self, world_size: int) -> None:
        self.port = free_port()
        self.world_size = world_size
        self.group: object = None
        self.sent = 0  # the last broadcast's tensors the ranks took
        self.error: Optional[RuntimeError] = None  # why the last broadcast stopped early

    def _run(self, work: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        return thread

    def join(self) -> threading.Thread:
        def work() -> None:  # the store waits for the service's ranks to connect
            store = dist.TCPStore("127.0.0.1", self.port, self.world_size, is_master=True,
                                  timeout=timedelta(seconds=60))
            keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{GROUP}/", dist.PrefixStore(
                GROUP, store)))
            self.group = dist.ProcessGroupGloo(keys, 0, self.world_size, timedelta(seconds=60))
        return self._run(work)

    def broadcast(self, tensors: List[torch.Tensor]) -> threading.Thread:
        """Each tensor in turn (`sent`, `error`: how it went)."""
        self.sent, self.error = 0, None

        def work() -> None:
            group: dist.ProcessGroup = self.group  # type: ignore[assignment]
            try:
                for t in tensors:
                    group.broadcast([t.contiguous()], dist.BroadcastOptions()).wait()
                    self.sent += 1
            except RuntimeError as e:  # the ranks left the group before taking every tensor
                self.error = e
        return self._run(work)


def _update(push: Callable[[List[str], List[str], List[List[int]]], None], trainer: Trainer,
            tensors: Dict[str, torch.Tensor], names: List[str]) -> threading.Thread:
    """Send `names` of `tensors` as one update: the trainer broadcasting while `push` asks
    the service to receive them; the trainer's thread (done once every tensor went)."""
    sending = trainer.broadcast([tensors[n] for n in names])
    push(names, [str(tensors[n].dtype).removeprefix("torch.") for n in names],
         [list(tensors[n].shape) for n in names])
    sending.join(60)
    return sending


@pytest.mark.parametrize("tp", [1, 2])
def test_offline_weights_from_a_trainers_group(two_llamas: List[Path], tp: int) -> None:
    case = push_case(two_llamas)
    prompts, tensors, names = case.prompts, case.tensors, case.names
    want_a, want_b = case.want_served, case.want_pushed
    with LLM(str(case.served), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        with pytest.raises(ValueError, match="cannot hold this service's"):
            llm.init_weights_update_group("127.0.0.1", 1, 1, tp, backend="gloo")
        trainer = Trainer(1 + tp)
        joining = trainer.join()
        llm.init_weights_update_group("127.0.0.1", trainer.port, 1, 1 + tp, backend="gloo")
        joining.join(60)
        push = llm.update_weights_from_distributed
        half = len(names) // 2
        for bucket in (names[:half], names[half:]):  # a trainer's buckets
            assert not _update(push, trainer, tensors, bucket).is_alive()
        assert greedy_tokens(llm, prompts) == want_b
        bad = dict(tensors, **{"model.layers.0.mlp.nothing.weight": torch.zeros(2, 3)})
        sending = trainer.broadcast([bad["model.layers.0.mlp.nothing.weight"],
                                     *(tensors[n] for n in names[:3])])
        with pytest.raises(ValueError, match="nothing"):
            push(["model.layers.0.mlp.nothing.weight", *names[:3]], ["float32"] * 4,
                 [[2, 3], *(list(tensors[n].shape) for n in names[:3])])
        sending.join(60)  # the ranks took every tensor the trainer sent, the bad one's too
        assert not sending.is_alive() and trainer.error is None and trainer.sent == 4
        assert greedy_tokens(llm, prompts) == want_a  # the checkpoint loaded from disk again
        assert not _update(push, trainer, tensors, names).is_alive()  # no tensor left behind
        assert trainer.error is None and greedy_tokens(llm, prompts) == want_b
        llm.destroy_weights_update_group()
        with pytest.raises(ValueError, match="no weight update group"):
            llm.destroy_weights_update_group()
        assert llm.check_accounting().live_requests == 0


def test_served_weights_from_a_trainers_group(two_llamas: List[Path], tmp_path: Path) -> None:
    """The HTTP endpoints, SGLang's bodies and answers; bad bodies are 400s naming why."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    a, b = two_llamas
    prompt = mixed_prompts(1, seed=41, lengths=(30,))[0]
    tensors = load_file(str(b / "model.safetensors"))
    names = sorted(tensors)
    with serving(["--model", str(a), *CPU_ARGS], tmp_path) as srv:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{srv.url}{path}", json=body, timeout=120)

        def generate() -> List[int]:
            r = post("/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
            return list(r.json()["output_ids"])

        trainer = Trainer(2)
        init = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1,
                "world_size": 2, "group_name": GROUP, "backend": "gloo"}
        for change, says in (({"world_size": 1}, "cannot hold"), ({"backend": "mpi"}, "backend")):
            r = post("/init_weights_update_group", dict(init, **change))
            assert r.status_code == 400 and r.json()["success"] is False, r.text
            assert says in r.json()["message"]
        joining = trainer.join()
        r = post("/init_weights_update_group", init)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        joining.join(60)

        def push(names: List[str], dtypes: List[str], shapes: List[List[int]]) -> None:
            r = post("/update_weights_from_distributed", {"names": names, "dtypes": dtypes,
                                                          "shapes": shapes,
                                                          "weight_version": "step-1"})
            assert r.status_code == 200 and r.json()["success"] is True, r.text

        def version() -> str:
            return str(httpx.get(f"{srv.url}/get_weight_version").json()["weight_version"])

        assert version() == "default"
        assert not _update(push, trainer, tensors, names).is_alive()
        assert generate() == hf_greedy(b, [prompt], 10)[0]
        # SGLang's weight version: the update's, on each reply and /get_model_info
        assert version() == "step-1"
        r = post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["weight_version"] == "step-1"
        r = post("/update_weight_version", {"new_version": "step-2"})
        assert r.json()["success"] is True and version() == "step-2"
        assert httpx.get(f"{srv.url}/get_model_info").json()["weight_version"] == "step-2"
        r = post("/update_weights_from_distributed", {"names": names[:1], "dtypes": ["fp4"],
                                                      "shapes": [[1]]})
        assert r.status_code == 400 and "unknown dtype 'fp4'" in r.json()["message"], r.text
        assert post("/destroy_weights_update_group", {}).json()["success"] is True
        r = post("/destroy_weights_update_group", {"group_name": GROUP})
        assert r.status_code == 400 and "no weight update group" in r.json()["message"]


def test_every_data_parallel_replica_joins_and_receives(two_llamas: List[Path],
                                                        tmp_path: Path) -> None:
    """--dp 2: replica d's rank joins as rank_offset + d (a wrong offset would meet another
    rank's place and never join), both receive every broadcast, and every prompt, on either
    replica, gets the pushed checkpoint's tokens."""
    import httpx
    from server_helpers import CPU_ARGS, serving
    a, b = two_llamas
    prompts = mixed_prompts(6, seed=47, lengths=(7, 30))
    want = hf_greedy(b, prompts, 8)
    tensors = load_file(str(b / "model.safetensors"))
    with serving(["--model", str(a), "--dp", "2", *CPU_ARGS], tmp_path) as srv:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{srv.url}{path}", json=body, timeout=120)

        trainer = Trainer(3)
        joining = trainer.join()
        r = post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1,
            "world_size": 3, "backend": "gloo"})
        assert r.json()["success"] is True, r.text
        joining.join(60)

        def push(names: List[str], dtypes: List[str], shapes: List[List[int]]) -> None:
            r = post("/update_weights_from_distributed", {"names": names, "dtypes": dtypes,
                                                          "shapes": shapes})
            assert r.json()["success"] is True, r.text

        assert not _update(push, trainer, tensors, sorted(tensors)).is_alive()
        assert [post("/generate", {"input_ids": p, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
                for p in prompts] == want


@pytest.mark.gpu
def test_gpu_weights_from_a_gloo_group(two_llamas: List[Path]) -> None:
    """On CUDA (graphs captured over the weights, which change in place): the tensors received
    on the host through gloo give the tokens of an engine that loaded that checkpoint."""
    a, b = two_llamas
    prompts = mixed_prompts(4, seed=43)
    tensors = load_file(str(b / "model.safetensors"))
    with LLM(str(b), show_progress=False) as fresh:
        want = greedy_tokens(fresh, prompts)
    with LLM(str(a), show_progress=False) as llm:
        trainer = Trainer(2)
        joining = trainer.join()
        llm.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, backend="gloo")
        joining.join(60)
        assert not _update(llm.update_weights_from_distributed, trainer, tensors,
                           sorted(tensors)).is_alive()
        assert greedy_tokens(llm, prompts) == want
