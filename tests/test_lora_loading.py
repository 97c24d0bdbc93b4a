"""LoRA adapters loaded and unloaded at run time, in the scheduler (a real Scheduler on the
fake engine, whose adapters shift the KV a request writes: tests/fake_engine.py).

What must hold: a request runs with the adapter its name meant when the scheduler took it,
to its end, whatever is unloaded or loaded meanwhile; an unloaded adapter's slot is reused
only once its requests finished; a prefix cached under one load never serves another; a
failed load changes nothing; every reply is one final TokenOut of the message's uid.
"""

from __future__ import annotations

import pytest

from minisgl.core import LoraBinding, RequestError
from minisgl.scheduler.adapters import AdapterTable
from tests.fake_engine import Harness, lora_reference, reference

PROMPT = list(range(1, 14))  # 13 tokens: three full pages of 4 for the prefix cache


def _cached(h: Harness, uid: int) -> int:
    """The prompt tokens request `uid` took from the prefix cache."""
    return max(o.cached_tokens for o in h.outs if o.uid == uid)


def test_loaded_adapter_serves_its_requests_and_the_base_model_stays() -> None:
    h = Harness(max_loras=2)
    h.adapter(100, "a", "/adapters/a")
    h.adapter(101, "b", "/adapters/b")
    h.submit(1, PROMPT, lora_name="a")
    h.submit(2, PROMPT, lora_name="b")
    h.submit(3, PROMPT)
    h.submit(4, PROMPT, lora_name="c")
    tokens = h.run()
    assert h.reply(100) == "ok" and h.reply(101) == "ok"
    assert tokens[1] == lora_reference(PROMPT, 8, "/adapters/a")
    assert tokens[2] == lora_reference(PROMPT, 8, "/adapters/b")
    assert tokens[3] == reference(PROMPT, 8)
    assert "LoRA adapter 'c' is not loaded (loaded: a, b)" in h.reply(4)
    assert len({tuple(tokens[u]) for u in (1, 2, 3)}) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_unloading_keeps_running_requests_and_frees_the_slot_after_them(overlap: bool) -> None:
    h = Harness(max_loras=1, overlap=overlap)
    h.adapter(100, "a", "/adapters/a")
    h.submit(1, PROMPT, max_tokens=12, lora_name="a")
    for _ in range(3):
        h.step()
    h.adapter(101, "a")  # unload while request 1 runs with it
    h.adapter(102, "b", "/adapters/b")  # its one slot is still bound to request 1
    h.submit(2, PROMPT, lora_name="a")
    h.step()
    assert h.reply(101) == "ok"
    assert "every one of the 1 LoRA adapter slots is taken" in h.reply(102)
    assert "LoRA adapter 'a' is not loaded (loaded: none)" in h.reply(2)
    h.run()
    assert h.tokens[1] == lora_reference(PROMPT, 12, "/adapters/a")
    h.adapter(103, "b", "/adapters/b")  # request 1 is done: the slot is free
    h.submit(3, PROMPT, lora_name="b")
    h.run()
    assert h.reply(103) == "ok"
    assert h.tokens[3] == lora_reference(PROMPT, 8, "/adapters/b")


def test_a_reloaded_name_never_matches_the_former_loads_prefix() -> None:
    h = Harness(max_loras=1)
    h.adapter(100, "a", "/adapters/a")
    h.submit(1, PROMPT, lora_name="a")
    h.run()
    h.submit(2, PROMPT, lora_name="a")  # the same load: shares the prefix
    h.run()
    assert _cached(h, 2) == 12 and h.tokens[2] == h.tokens[1]
    h.adapter(101, "a")
    h.adapter(102, "a", "/adapters/a2")  # same name, other weights
    h.submit(3, PROMPT, lora_name="a")
    h.run()
    assert [h.reply(u) for u in (101, 102)] == ["ok", "ok"]
    assert _cached(h, 3) == 0
    assert h.tokens[3] == lora_reference(PROMPT, 8, "/adapters/a2")


def test_failed_or_refused_changes_change_nothing() -> None:
    h = Harness(max_loras=1)
    h.adapter(100, "a", "/adapters/bad")
    h.adapter(101, "a")  # never loaded
    h.adapter(102, "b", "/adapters/b")  # the failed load left its slot free
    h.adapter(103, "b", "/adapters/b2")  # already loaded
    h.submit(1, PROMPT, lora_name="b")
    h.run()
    assert "no adapter_config.json in /adapters/bad" in h.reply(100)
    assert h.reply(101) == "LoRA adapter 'a' is not loaded"
    assert h.reply(102) == "ok"
    assert h.reply(103) == "LoRA adapter 'b' is already loaded"
    assert h.tokens[1] == lora_reference(PROMPT, 8, "/adapters/b")
    assert h.engine.slot_codes.keys() == {0}


def test_an_engine_without_slots_refuses_loads_and_adapter_requests() -> None:
    h = Harness()
    h.adapter(100, "a", "/adapters/a")
    h.submit(1, PROMPT, lora_name="a")
    h.run()
    assert "at run time needs --enable-lora (or --max-loras)" in h.reply(100)
    assert "serves none (start it with --enable-lora" in h.reply(1)


def test_a_load_another_rank_failed_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(max_loras=1)
    monkeypatch.setattr("minisgl.distributed.comm.min_over_ranks", lambda v, g: 0)
    h.adapter(100, "a", "/adapters/a")
    h.run()
    assert "loading LoRA adapter 'a' failed on another rank" in h.reply(100)
    assert h.engine.slot_codes == {} and h.sched.adapters.loaded == {}


def test_adapter_table_binds_and_reuses_slots_in_order() -> None:
    table = AdapterTable(2, ["x"])
    assert table.bind("x") == LoraBinding(0, 0) and table.bind(None) is None
    assert table.free_slot([]) == 1
    assert table.add("y", 1) == LoraBinding(1, 1)
    assert table.free_slot([]) is None
    assert table.remove("x") and not table.remove("x")
    assert table.free_slot([LoraBinding(0, 0)]) is None  # still bound to a live request
    assert table.free_slot([None]) == 0
    with pytest.raises(RequestError, match="'x' is not loaded \\(loaded: y\\)"):
        table.bind("x")
    with pytest.raises(ValueError, match="2 LoRA adapters for 1 slots"):
        AdapterTable(1, ["a", "b"])


def test_stats_name_the_running_and_waiting_adapters_for_lora_aware_gateways() -> None:
    """With LoRA slots the scheduler's stats name the adapters its admitted requests run with
    and those its waiting ones ask for, sorted, and its slots; /metrics renders them as vLLM's
    `vllm:lora_requests_info` (what LoRA-aware gateways route by). Without slots: nothing."""
    from minisgl.message.types import SchedulerStats
    from minisgl.server.metrics_vllm import vllm_lines
    h = Harness(max_loras=2, max_running_requests=1)
    h.adapter(100, "b", "/adapters/b")
    h.adapter(101, "a", "/adapters/a")
    h.run()
    h.submit(1, PROMPT, max_tokens=30, lora_name="b")
    h.submit(2, PROMPT, lora_name="a")
    h.submit(3, PROMPT)
    h.step()
    stats = h.sched.stats()
    assert (stats.running_adapters, stats.waiting_adapters, stats.lora_slots) == (
        ("b",), ("a",), 2)
    assert stats.stats_time > 0
    from minisgl.message.codec import decode, encode
    assert decode(encode(stats)) == stats  # the stats cross to the API server as a message
    line, = [x for x in vllm_lines("m", [stats], {}, {}) if x.startswith("vllm:lora_")]
    assert line.startswith('vllm:lora_requests_info{max_lora="2",running_lora_adapters="b",'
                           'waiting_lora_adapters="a",engine="0"} ')
    h.run()
    assert h.sched.stats().running_adapters == ()
    plain = Harness().sched.stats()
    assert (plain.running_adapters, plain.lora_slots) == ((), 0)
    assert not [x for x in vllm_lines("m", [plain, SchedulerStats()], {}, {}) if "lora" in x]
