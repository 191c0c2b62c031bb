"""msgpack encoding of control messages. Every message is a map with a "t" (type) field."""

from __future__ import annotations

import msgpack


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict:
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError as e:  # e.g. a map keyed by an array: unhashable in Python
        raise ValueError(f"undecodable control message: {e}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError("control message must be a map with a 't' field")
    return msg
