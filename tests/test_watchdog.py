"""The launcher's watchdog (server/watchdog.py) on pulses (message/pulse.py) it reads at chosen
times, and where the ranks listen (distributed/bind.py). In-process; the real processes are
tests/test_shutdown.py's."""

from __future__ import annotations

import os
import time
from typing import List, Optional

import pytest

from minisgl.distributed.bind import (GLOO_IFNAME, address_towards, interface_of, is_loopback,
                                      listening_socket, pin_gloo)
from minisgl.message.pulse import Pulse
from minisgl.server.proc import Child, new_pulse
from minisgl.server.watchdog import FIRST_STEP_FACTOR, STALE_S, judge


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        return True


def _child(name: str, pid: int) -> Child:
    return Child(name, _Process(pid), None, new_pulse())


def _set(pulse: Pulse, beat: Optional[float] = None, step: Optional[float] = None) -> None:
    """Pretend the child last beat at `beat` / began its step at `step` (monotonic times)."""
    if beat is not None:
        pulse._slots[0] = beat
    if step is not None:
        pulse._slots[1] = step


@pytest.fixture
def kids() -> List[Child]:
    return [_child("tokenizer", 10), _child("rank0", 11), _child("rank1", 12)]


def _beat_all(children: List[Child]) -> float:
    for c in children:
        c.pulse.beat()
    return time.monotonic()


def test_fresh_beats_are_healthy(kids: List[Child]) -> None:
    now = _beat_all(kids)
    assert judge(kids, kids[1:], 300.0, now) == (None, True)


def test_a_silent_child_is_unhealthy_at_once_and_fails_past_the_timeout(
        kids: List[Child]) -> None:
    now = _beat_all(kids)
    kids[0].pulse.beat()
    later = now + STALE_S + 0.1
    for c in kids[1:]:  # the others keep beating; the tokenizer stopped at `now`
        _set(c.pulse, beat=later)
    assert judge(kids, kids[1:], 300.0, later) == (None, False)
    verdict = judge(kids, kids[1:], 3.0, now + 3.5)
    assert verdict.healthy is False and verdict.failure is not None
    assert "tokenizer (pid 10) showed no sign of life" in verdict.failure
    assert "watchdog_timeout 3 s" in verdict.failure


def test_a_short_timeout_halves_the_stale_bound(kids: List[Child]) -> None:
    now = _beat_all(kids)
    assert judge(kids, [], 1.0, now + 0.6).healthy is False  # stale past 0.5 s, not 1.5


def test_a_step_past_the_timeout_fails_and_the_first_step_gets_more(kids: List[Child]) -> None:
    rank = kids[1]
    now = _beat_all(kids)
    rank.pulse.step_begins()  # the first step
    for c in kids:
        _set(c.pulse, beat=now + 10)
    assert judge(kids, kids[1:], 4.0, now + 10).failure is None  # under 3 x 4 s
    later = now + 4.0 * FIRST_STEP_FACTOR + 0.5
    for c in kids:
        _set(c.pulse, beat=later)
    verdict = judge(kids, kids[1:], 4.0, later)
    assert verdict.failure is not None and "tripled for its first step" in verdict.failure
    rank.pulse.idle()
    rank.pulse.step_begins()  # a later step: the plain timeout
    assert rank.pulse.steps == 1
    start = now + 1
    _set(rank.pulse, step=start)
    for c in kids:
        _set(c.pulse, beat=start + 5)
    verdict = judge(kids, kids[1:], 4.0, start + 5)
    assert verdict.failure is not None
    assert verdict.failure.startswith("rank0 (pid 11) is hung: its step has run for 5.0 s")


def test_a_waiting_rank_is_never_hung(kids: List[Child]) -> None:
    now = _beat_all(kids)
    kids[1].pulse.step_begins()
    kids[1].pulse.idle()
    for c in kids:
        _set(c.pulse, beat=now + 1000)
    assert judge(kids, kids[1:], 4.0, now + 1000) == (None, True)


def test_a_step_waiting_on_a_silent_peer_blames_the_peer(kids: List[Child]) -> None:
    now = _beat_all(kids)
    kids[1].pulse.idle()
    kids[1].pulse.step_begins()
    kids[1].pulse.idle()
    _set(kids[1].pulse, step=now)  # rank0's step began at `now`
    _set(kids[0].pulse, beat=now + 5)
    _set(kids[1].pulse, beat=now + 5)
    _set(kids[2].pulse, beat=now + 2.5)  # rank1 went silent 2.5 s ago
    verdict = judge(kids, kids[1:], 4.0, now + 5)
    assert verdict.failure is not None and verdict.failure.startswith(
        "rank1 (pid 12) showed no sign of life for 2.5 s while rank0's step waited 5.0 s")


# --- where the ranks listen ---------------------------------------------------------------------
def test_loopback_binds_loopback_and_pins_gloo_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.0.0.1")
    assert address_towards("127.0.0.1") == "127.0.0.1"
    lo = interface_of("127.0.0.1")
    assert lo is not None and lo.startswith("lo")
    monkeypatch.setenv(GLOO_IFNAME, "eth-user")  # one host: loopback wins over the user's
    pin_gloo("127.0.0.1")
    assert os.environ[GLOO_IFNAME] == lo
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_another_address_keeps_a_gloo_interface_the_user_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_IFNAME, "eth-user")
    pin_gloo("10.11.12.13")
    assert os.environ[GLOO_IFNAME] == "eth-user"
    monkeypatch.delenv(GLOO_IFNAME)
    with pytest.raises(ValueError, match="no network interface holds 10.11.12.13"):
        pin_gloo("10.11.12.13")


def test_no_route_names_the_host() -> None:
    with pytest.raises(ValueError, match="no-such-host.invalid"):
        address_towards("no-such-host.invalid")
