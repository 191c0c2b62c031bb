"""Encoding of the messages between processes (ipc/messages.py): msgpack arrays through msgspec, one decoder per
socket for the union of what that socket carries. A frame that is not one of them raises ValueError
(msgspec.DecodeError / ValidationError are ValueErrors)."""

from __future__ import annotations

import msgspec

from .messages import CmdMsg, DraftsMsg, StatusMsg, ToDrafterMsg

_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


decode_cmd = msgspec.msgpack.Decoder(CmdMsg).decode                # scheduler -> drafter
decode_drafts = msgspec.msgpack.Decoder(DraftsMsg).decode          # drafter -> verifier, scheduler
decode_to_drafter = msgspec.msgpack.Decoder(ToDrafterMsg).decode   # verifier -> drafter
decode_status = msgspec.msgpack.Decoder(StatusMsg).decode          # workers -> scheduler
