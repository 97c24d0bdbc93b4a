"""msgpack encoding of the messages in `types`, behind a type tag.

Wire format: a msgpack map `{"t": <type name>, "f": {field: value}}`, a field left out where
it holds its class's plain default (the same type and value: decoding gives it back), so that
a request's params cost only what it sets. Lists of token ids are packed as little-endian
int32 bytes (`ExtType` 1), four bytes a token instead of up to nine.
`decode(encode(m)) == m` for every message type (tested).
"""

from __future__ import annotations

import dataclasses
import functools
from array import array
from typing import Any, Dict, FrozenSet, Tuple, Type

import msgpack

from minisgl.core import SamplingParams, StructuredOutput, TokenLogprobs
from minisgl.message import types as T

_TOKEN_FIELDS = frozenset({"input_ids", "token_ids", "prompt_ids"})
_INT32_EXT = 1

_TYPES: Dict[str, Type[Any]] = {
    cls.__name__: cls
    for cls in (T.TokenizeRequest, T.AbortRequest, T.UserMsg, T.AbortMsg, T.ShutdownMsg,
                T.TokenOut, T.BatchTokenOut, T.SchedulerStats, T.ReplyChunk, SamplingParams,
                T.DetokenizeInit, T.ReplyBatch, TokenLogprobs, T.TokenLogprobText,
                T.TextRequest, T.ServiceDown, T.Drain, StructuredOutput, T.AccountingMsg,
                T.AccountingReply, T.ReplicaChange, T.AdapterMsg, T.WeightsMsg,
                T.FlushCacheMsg, T.SleepMsg, T.WakeMsg, T.GroupMsg, T.GroupWeightsMsg,
                T.PauseMsg, T.PhaseTimes, T.TensorWeightsMsg, T.ProfileMsg, T.WeightReadMsg,
                T.WireTensor)
}


# Field lists per class, read once: every step encodes and decodes hundreds of these objects.
@functools.lru_cache(maxsize=None)
def _field_names(cls: Type[Any]) -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _tuple_fields(cls: Type[Any]) -> FrozenSet[str]:
    """msgpack has no tuple: the tuple-typed fields get their type back on decode."""
    return frozenset(f.name for f in dataclasses.fields(cls) if "Tuple" in str(f.type))


@functools.lru_cache(maxsize=None)
def _nested_tuple_fields(cls: Type[Any]) -> FrozenSet[str]:
    """Tuples of tuples (GroupWeightsMsg.shapes): their items get their type back too."""
    return frozenset(f.name for f in dataclasses.fields(cls)
                     if str(f.type).startswith("Tuple[Tuple["))


@functools.lru_cache(maxsize=None)
def _plain_defaults(cls: Type[Any]) -> Dict[str, Any]:
    """The fields with a plain default (not a factory's), and that default."""
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def _pack_ids(ids: Any) -> msgpack.ExtType:
    buf = array("i", ids)
    if buf.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return msgpack.ExtType(_INT32_EXT, buf.tobytes())


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {}
        defaults = _plain_defaults(type(obj))
        for name in _field_names(type(obj)):
            value = getattr(obj, name)
            if name in defaults:
                default = defaults[name]
                if type(value) is type(default) and value == default:
                    continue
            if name in _TOKEN_FIELDS and value is not None:
                fields[name] = _pack_ids(value)
            else:
                fields[name] = _to_wire(value)
        return {"t": type(obj).__name__, "f": fields}
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    return obj


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _INT32_EXT:
        raise ValueError(f"unknown msgpack extension type {code}")
    return array("i", data).tolist()


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, dict) and "t" in obj and "f" in obj:
        cls: Any = _TYPES.get(obj["t"])  # Any: mypy does not see a class as Hashable
        if cls is None:
            raise ValueError(f"unknown message type {obj['t']!r}")
        wire, tuples = obj["f"], _tuple_fields(cls)
        kwargs = {}
        for name in _field_names(cls):
            if name in wire:
                value = _from_wire(wire[name])
                if name in tuples and isinstance(value, list):
                    value = tuple(tuple(v) for v in value) if name in _nested_tuple_fields(
                        cls) else tuple(value)
                kwargs[name] = value
        return cls(**kwargs)
    if isinstance(obj, list):
        return [_from_wire(x) for x in obj]
    return obj


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    return _from_wire(msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=False))
