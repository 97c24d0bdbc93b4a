"""Messages between processes and their msgpack encoding."""

from minisgl.message.codec import decode, encode
from minisgl.message.types import (AbortMsg, AbortRequest, BatchTokenOut, ReplyChunk,
                                   SchedulerStats, ShutdownMsg, TokenizeRequest, TokenOut,
                                   UserMsg)

__all__ = ["decode", "encode", "AbortMsg", "AbortRequest", "BatchTokenOut", "ReplyChunk",
           "SchedulerStats", "ShutdownMsg", "TokenizeRequest", "TokenOut", "UserMsg"]
