"""A conversation cut to fit the context by dropping its oldest turns (the Responses API's
`truncation: "auto"`): the leading system / developer messages stay, then whole turns go, oldest
first, a turn being a user message and everything after it up to the next user message (so the
rest still starts with a user message, as templates that check roles want, and no tool result
loses its call). The last turn, which holds the new input, always stays. The tokenizer finds
the fewest turns to drop by bisection: fewer turns make a shorter prompt.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

Message = Dict[str, Any]
_HEAD_ROLES = ("system", "developer")


def split_turns(messages: List[Message]) -> Tuple[List[Message], List[List[Message]]]:
    """(the leading system / developer messages, the turns after them)."""
    head = 0
    while head < len(messages) and messages[head].get("role") in _HEAD_ROLES:
        head += 1
    turns: List[List[Message]] = []
    for m in messages[head:]:
        if not turns or m.get("role") == "user":
            turns.append([])
        turns[-1].append(m)
    return messages[:head], turns


def without_oldest(messages: List[Message], k: int) -> List[Message]:
    """The conversation with its `k` oldest turns dropped."""
    head, turns = split_turns(messages)
    return [*head, *(m for turn in turns[k:] for m in turn)]


def fewest_dropped(messages: List[Message], fits: Callable[[List[Message]], bool]
                   ) -> Optional[List[Message]]:
    """The conversation with the fewest oldest turns dropped (at least one) that `fits`, or
    None where even its last turn alone (with the head) does not. `fits` is tried on
    O(log turns) conversations."""
    last = len(split_turns(messages)[1]) - 1
    if last < 1 or not fits(without_oldest(messages, last)):
        return None
    lo, hi = 1, last  # hi fits; find the smallest k in [lo, hi] that does
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(without_oldest(messages, mid)):
            hi = mid
        else:
            lo = mid + 1
    return without_oldest(messages, hi)
