"""Receiving and sending msgspec messages on ZeroMQ sockets, the same way in every process.

Every receiver decodes with a typed decoder (one struct, or a tagged union of them); a
message that does not decode is logged and dropped, never allowed to stop the receiver.
Sends that must not block (to a peer that may be restarting) drop the message instead.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")


def decode_or_drop(
    decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview, logger: logging.Logger
) -> T | None:
    """The decoded message, or None (logged) when `data` is malformed."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:
        logger.error("dropping a malformed message (%d bytes): %s", len(data), e)
        return None


def receive(
    sock: zmq.Socket, decoder: msgspec.msgpack.Decoder[T], logger: logging.Logger
) -> Iterator[T]:
    """Every well-formed message that arrives on `sock`, forever (blocking)."""
    while True:
        frame = sock.recv(copy=False)  # decode straight from ZeroMQ's buffer
        msg = decode_or_drop(decoder, frame.buffer, logger)
        if msg is not None:
            yield msg


def receive_nowait(
    sock: zmq.Socket,
    decoder: msgspec.msgpack.Decoder[T],
    logger: logging.Logger,
    timeout_s: float = 0.0,
) -> Iterator[T]:
    """The well-formed messages that arrive within `timeout_s` (then whatever else is
    already queued), for a loop that has other things to watch too."""
    if not sock.poll(int(timeout_s * 1000)):
        return
    while True:
        try:
            frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        msg = decode_or_drop(decoder, frame.buffer, logger)
        if msg is not None:
            yield msg


async def areceive(
    sock: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder[T], logger: logging.Logger
) -> AsyncIterator[T]:
    """`receive` for asyncio sockets."""
    while True:
        data = await sock.recv()
        msg = decode_or_drop(decoder, data, logger)
        if msg is not None:
            yield msg


def send_nowait(
    sock: zmq.Socket, encoder: msgspec.msgpack.Encoder, msg: Any, logger: logging.Logger
) -> bool:
    """Send without blocking; False (logged) when the receiver is gone or not keeping up
    (it is restarting, and the requests it served are failed by the supervisor)."""
    try:
        sock.send(encoder.encode(msg), flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        logger.warning("dropping a %s: its receiver is not keeping up", type(msg).__name__)
        return False


def detokenizer_index(req_id: str, num_workers: int) -> int:
    """Which detokenizer owns a request: stable across processes (unlike `hash`)."""
    return zlib.crc32(req_id.encode()) % num_workers
