"""Prefill/decode disaggregation, the executor's side: the bytes of KV blocks between a
producer's pool and a consumer's (zllm/config/kv_transfer.py says who does what; the cores
decide which blocks: core/kv/connector.py).

    producer                                       consumer
    step's forward writes the prompt's KV          KVReceiver thread: PULL bound at kv_ip:kv_port
    KVSender.send: gather the blocks (now:         check the layout, put the blocks into the
      the next step may reuse them), then a         RemoteKVBuffer (LRU, kv_buffer_size), tell
      thread sends them: PUSH ─────────────────►    the core what it holds (KVBlocksReceived)
      [KVBlocksHeader, bytes]   (tcp)
      [KVBlocksHeader] + a /dev/shm file (shm)     core admits the request: its blocks load
                                                    from the buffer like a KV tier's (TIER_REMOTE)

Nothing waits for the peer: a producer whose consumer is gone drops the blocks (ZeroMQ
IMMEDIATE: nothing queues for a peer that is not connected), as does one with kv_buffer_size
bytes already queued; a consumer whose buffer is full drops its oldest blocks, and a block
that is not there when its load comes is recomputed (executor/model_runner.py
`_transfer_kv`). Blocks are keyed by the hash chain of their tokens (zllm/kv/block_hash.py), the
same in both engines.

A consumer with several data-parallel engines listens in each engine's executors, each on
its own ports (kv_port + engine x ranks + rank); a producer's sender keeps a socket per
consumer engine and sends each request's blocks to the one its core names (the engine the
consumer routes that request to: zllm/config/kv_transfer.py `consumer_engine`).

With tensor parallelism or pipeline stages every rank (stage x tp size + tp rank) does this
for its part of each block (its KV heads of its stage's layers, sent after its stage's
forward): producer rank r to consumer rank r's receiver at kv_port + r, and each consumer
rank tells the core what its buffer holds (the core counts a block once every rank holds
it; a load that fails on one rank is recomputed on all, model_runner.py; with stages such
loads are prefetched: core/kv/prefetch.py). The layout names the ranks, stages and rank, so
a peer cut otherwise has its blocks dropped.

Shared-memory files are named `zllm-kv-<producer pid>-<consumer port>-<n>`; a consumer with
the shm transport reads only such names for its own port, owned by its own user, and deletes
each once read (or refused). Files never read go at a later start: a dead producer's at the
next start of either side (its pid is gone), and those a consumer left unread when it died,
while their producer lives on, when the next consumer binds that port
(`remove_unread_shm_files`: once it holds the port, nobody else here reads them).

A consumer refuses blocks of another model, weights or layout with a logged error (once per
foreign layout) and counts them for its core (`KVBlocksReceived.rejected`, by KVRejection:
zllm:kv_transfer_rejected_blocks_total{reason}), as it counts a malformed message.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import torch
import zmq

from zllm.config.engine import EngineConfig
from zllm.config.kv_transfer import KVTransferConfig
from zllm.executor.kv.pool import KVPool
from zllm.kv.block_hash import BlockHash
from zllm.model.fingerprint import weights_fingerprint
from zllm.protocol import KVBlocksHeader, KVBlocksReceived, KVRejection

logger = logging.getLogger(__name__)

# Where the shm transport's files go: memory-backed on Linux.
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"zllm-kv-(\d+)-(\d+)-\d+")  # producer pid, consumer port, number
# Messages ZeroMQ queues on either side of the socket (each may be a whole prompt's KV).
SOCKET_QUEUE_MESSAGES = 4
# Foreign layouts a receiver remembers having logged (each is logged once, then counted).
_LOGGED_LAYOUTS = 64


def transfer_layout(config: EngineConfig, rank: int = 0) -> str:
    """What a block's bytes depend on, which two engines must share to exchange blocks:
    the model (its name and weights fingerprint), its KV layout, dtype
    and block size, which rank's part of it (`rank`: stage x tp size + tp rank) of how many
    ranks and stages, and a draft model's, whose KV travels in the same blocks."""
    arch = config.arch
    stages = config.pipeline_parallel_size
    return (
        f"{_model_name(config.model_path)}:{arch.architecture}:"
        f"{arch.num_layers}x{arch.num_kv_heads}x{arch.head_dim}:{config.kv_dtype}:"
        f"{config.cache.block_size}:{config.quantization}:"
        f"tp{config.tensor_parallel_size}.{rank}"
        + (f":pp{stages}" if stages > 1 else "")  # (one stage: the layout as ever)
        + _draft_layout(config)
    )


def _draft_layout(config: EngineConfig) -> str:
    """The draft model's part of the layout ("" without one: the target's layout as ever)."""
    spec = config.speculative
    if spec is None or spec.draft_arch is None or spec.draft_model_path is None:
        return ""
    arch = spec.draft_arch
    return (
        f":draft:{_model_name(spec.draft_model_path)}:{arch.architecture}:"
        f"{arch.num_layers}x{arch.num_kv_heads}x{arch.head_dim}:{config.dtype}"
    )


def _model_name(path: str) -> str:
    """A model's file or directory name (for people) and its weights' fingerprint (the
    contents: another model of the same name and size differs, zllm/model/fingerprint.py)."""
    return f"{os.path.basename(path.rstrip('/'))}:{weights_fingerprint(path)}"


class KVSender:
    """A producer's sends: `send` copies the blocks out of the pool at once; a thread puts
    them on the wire, to the consumer engine each block's request is served by."""

    def __init__(
        self, config: KVTransferConfig, pool: KVPool, layout: str, rank: int = 0, ranks: int = 1
    ) -> None:
        """`rank`: this executor rank (of `ranks`, every stage's), which sends its part of
        each block to the consumer's rank of the same number, in each consumer engine."""
        self.config = config
        self.pool = pool
        self.layout = layout
        # One address (and socket) per consumer engine: each has its own buffer.
        self.addresses = [
            config.engine_address(engine, rank, ranks) for engine in range(config.consumer_engines)
        ]
        # (A file names the consumer's port, so a consumer restarting can tell its own.)
        self._ports = [
            config.engine_port(engine, rank, ranks) for engine in range(config.consumer_engines)
        ]
        self._file_numbers = itertools.count()
        self._queue: queue.SimpleQueue[tuple[int, KVBlocksHeader, torch.Tensor | None, int]] = (
            queue.SimpleQueue()
        )
        # Bytes queued and not yet handed to the socket, at most kv_buffer_size.
        self._queued_bytes = 0
        self._lock = threading.Lock()
        if config.transport == "shm":
            remove_orphaned_shm_files()
        self._thread = threading.Thread(target=self._send_loop, name="kv-send", daemon=True)
        self._thread.start()

    def send(self, sends: Sequence[tuple[BlockHash, int]], engines: Sequence[int] = ()) -> None:
        """Send these (block hash, block id) pool blocks to the consumer: sends[i] to its
        engine engines[i] (none given: all to engine 0)."""
        if not engines:
            self._send_to(0, sends)
            return
        by_engine: dict[int, list[tuple[BlockHash, int]]] = {}
        for send, engine in zip(sends, engines, strict=True):
            by_engine.setdefault(engine, []).append(send)
        for engine, own in by_engine.items():
            self._send_to(engine, own)

    def _send_to(self, engine: int, sends: Sequence[tuple[BlockHash, int]]) -> None:
        if not sends:
            return
        if not 0 <= engine < len(self.addresses):  # (a core's config this one does not share)
            self._dropped(engine, len(sends))
            return
        hashes = [h for h, _ in sends]
        block_ids = [b for _, b in sends]
        dtype = self.pool.block_dtype  # uint8 with a draft model's part (kv_pool.py)
        nbytes = len(sends) * self.pool.block_nbytes
        with self._lock:
            if self._queued_bytes + nbytes > self.config.buffer_bytes:
                full = True
            else:
                full = False
                self._queued_bytes += nbytes
        if full:  # the consumer does not keep up: it recomputes these
            self._dropped(engine, len(sends))
            return
        header = KVBlocksHeader(
            hashes=hashes,
            layout=self.layout,
            dtype=str(dtype).removeprefix("torch."),
            block_shape=list(self.pool.block_shape),
        )
        payload = None
        if self.config.transport == "shm":
            try:
                header.shm_file = self._write_shm(block_ids, self._ports[engine])
            except OSError as e:  # /dev/shm full, a name taken, ...: the consumer recomputes
                with self._lock:
                    self._queued_bytes -= nbytes
                self._dropped(engine, len(sends), f"could not write them to {SHM_DIR}: {e}")
                return
        else:
            payload = self.pool.gather(block_ids)
        self._queue.put((engine, header, payload, nbytes))

    def _write_shm(self, block_ids: list[int], port: int) -> str:
        """The blocks, gathered straight into a new file in /dev/shm for the consumer at
        `port`; returns its name."""
        name = f"zllm-kv-{os.getpid()}-{port}-{next(self._file_numbers)}"
        path = os.path.join(SHM_DIR, name)
        shape = (len(block_ids), *self.pool.block_shape)
        nbytes = len(block_ids) * self.pool.block_nbytes
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: a file only truncated to size would fail its first write
            # into a full tmpfs with SIGBUS, which kills the process; this raises ENOSPC.
            os.posix_fallocate(fd, 0, nbytes)
            import mmap

            with mmap.mmap(fd, nbytes) as mapped:
                out = torch.frombuffer(mapped, dtype=torch.uint8)
                out = out.view(self.pool.block_dtype).view(shape)
                self.pool.gather(block_ids, out=out)
                del out  # (the mapping closes only once no tensor views it)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return name

    def _send_loop(self) -> None:
        socks = [self._connect(address) for address in self.addresses]
        encoder = msgspec.msgpack.Encoder()
        while True:
            engine, header, payload, nbytes = self._queue.get()
            frames = [encoder.encode(header)]
            if payload is not None:
                frames.append(payload.contiguous().view(torch.uint8).numpy())
            try:
                socks[engine].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._dropped(engine, len(header.hashes))
                if header.shm_file:
                    _unlink(header.shm_file)
            with self._lock:
                self._queued_bytes -= nbytes

    @staticmethod
    def _connect(address: str) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a consumer that is not there
        sock.setsockopt(zmq.SNDHWM, SOCKET_QUEUE_MESSAGES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def _dropped(self, engine: int, count: int, why: str = "it is not taking blocks") -> None:
        address = self.addresses[engine] if 0 <= engine < len(self.addresses) else engine
        logger.warning(
            "KV transfer: %d blocks for the consumer at %s dropped (it recomputes): %s",
            count,
            address,
            why,
        )


class RemoteKVBuffer:
    """A consumer's received blocks: `capacity` slots, least recently arrived dropped first;
    the KV tier the core's TIER_REMOTE index mirrors. Filled by the receiver thread, read by
    the model runner's loads (hence the lock)."""

    def __init__(self, pool: KVPool, capacity: int, pin_memory: bool) -> None:
        self.pool = pool
        self.capacity = capacity
        self.buffer = torch.empty(
            (capacity, *pool.block_shape), dtype=pool.block_dtype, pin_memory=pin_memory
        )
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.lock = threading.Lock()

    def put(self, hashes: Sequence[BlockHash], blocks) -> tuple[list[BlockHash], list[BlockHash]]:
        """Store blocks[i] (a [block_shape] tensor, or a callable filling one) under hashes[i];
        returns (stored, removed to make room)."""
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        with self.lock:
            for i, block_hash in enumerate(hashes[: self.capacity]):
                slot = self.slots.get(block_hash)
                if slot is None:
                    if not self.free_slots:
                        old, freed = self.slots.popitem(last=False)
                        self.free_slots.append(freed)
                        removed.append(old)
                    slot = self.free_slots.pop()
                self.slots[block_hash] = slot
                self.slots.move_to_end(block_hash)
                target = self.buffer[slot]
                if callable(blocks):
                    blocks(i, target)
                else:
                    target.copy_(blocks[i])
                stored.append(block_hash)
            return stored, [h for h in removed if h not in self.slots]

    # ---- the KV tier interface (executor/kv/connector.py KVTier) ----------------------------
    def store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        raise RuntimeError("the remote KV buffer is filled by its producer, not by the core")

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[int]:
        with self.lock:
            missing = [i for i, h in enumerate(block_hashes) if h not in self.slots]
            found = [i for i, h in enumerate(block_hashes) if h in self.slots]
            if found:
                slots = [self.slots[block_hashes[i]] for i in found]
                self.pool.scatter([block_ids[i] for i in found], self.buffer[slots])
        return missing

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        with self.lock:
            for block_hash in block_hashes:
                slot = self.slots.pop(block_hash, None)
                if slot is not None:
                    self.free_slots.append(slot)


class KVReceiver:
    """A consumer's thread: blocks from producers into the buffer, news of them to the core."""

    def __init__(
        self,
        config: KVTransferConfig,
        buffer: RemoteKVBuffer,
        layout: str,
        core_in: str,
        rank: int = 0,
        engine: int = 0,
        ranks: int = 1,
    ) -> None:
        """`rank`: this executor rank (of `ranks`, every stage's) of data-parallel engine
        `engine`: it listens at kv_port + engine x ranks + rank for its peer rank's parts of
        blocks, and names itself in what it tells the core."""
        self.config = config
        self.buffer = buffer
        self.layout = layout
        self.core_in = core_in
        self.rank = rank
        self.port = config.engine_port(engine, rank, ranks)
        self._logged_layouts: set[str] = set()
        address = config.engine_address(engine, rank, ranks)
        if config.transport == "shm":
            remove_orphaned_shm_files()
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, SOCKET_QUEUE_MESSAGES)
        try:  # here, so a port in use fails the executor's start, saying so
            sock.bind(address)
        except zmq.ZMQError as e:
            raise RuntimeError(
                f"--kv-transfer-config: cannot listen for KV blocks at {address} "
                f"(engine {engine}'s rank {rank}: kv_port + {engine * ranks + rank}): {e}"
            ) from e
        self._sock = sock
        if config.transport == "shm":  # (now that this port is ours: a previous life's files)
            remove_unread_shm_files(self.port)
        threading.Thread(target=self._receive_loop, name="kv-receive", daemon=True).start()

    def _receive_loop(self) -> None:
        to_core = zmq.Context.instance().socket(zmq.PUSH)
        to_core.connect(self.core_in)
        decoder = msgspec.msgpack.Decoder(KVBlocksHeader)
        encoder = msgspec.msgpack.Encoder()
        while True:
            frames = self._sock.recv_multipart(copy=False)
            try:
                header = decoder.decode(frames[0].buffer)
            except msgspec.DecodeError as e:
                logger.warning("KV transfer: a malformed message dropped: %s", e)
                continue
            news = self.take(header, frames[1:])
            if news is not None:
                to_core.send(encoder.encode(news))

    def take(self, header: KVBlocksHeader, frames: list) -> KVBlocksReceived | None:
        """Store one message's blocks; the core's news of them: stored and removed, or
        refused and why (None: nothing to tell)."""
        count = len(header.hashes)
        try:
            stored, removed = self._store(header, frames)
        except ForeignBlocks as e:
            self._discard_file(header)  # (unread: its producer lives on, and would fill /dev/shm)
            if str(e) not in self._logged_layouts:  # (every prompt of the pair would log)
                if len(self._logged_layouts) < _LOGGED_LAYOUTS:
                    self._logged_layouts.add(str(e))
                logger.error(
                    "KV transfer: %d blocks refused: %s; further blocks of it are only counted "
                    '(zllm:kv_transfer_rejected_blocks_total{reason="layout"})',
                    count,
                    e,
                )
            return KVBlocksReceived(rank=self.rank, rejected=count, rejection=KVRejection.LAYOUT)
        except (ValueError, OSError) as e:
            self._discard_file(header)
            logger.warning("KV transfer: %d blocks dropped: %s", count, e)
            return KVBlocksReceived(rank=self.rank, rejected=count, rejection=KVRejection.INVALID)
        if not stored and not removed:
            return None
        return KVBlocksReceived(stored=stored, removed=removed, rank=self.rank)

    def _store(self, header: KVBlocksHeader, frames: list) -> tuple[list, list]:
        """The blocks into the buffer: (stored, removed to make room). ForeignBlocks for
        another layout; ValueError or OSError for a message that is wrong."""
        if header.layout != self.layout:
            raise ForeignBlocks(
                f"blocks of another model, weights or KV layout ({header.layout!r}; this "
                f"engine's is {self.layout!r})"
            )
        dtype = self.buffer.buffer.dtype
        shape = tuple(self.buffer.buffer.shape[1:])
        if header.dtype != str(dtype).removeprefix("torch.") or tuple(header.block_shape) != shape:
            raise ForeignBlocks(
                f"blocks of {header.dtype} {header.block_shape}, not {dtype} {list(shape)}"
            )
        block_bytes = self.buffer.buffer[0].numel() * self.buffer.buffer.element_size()
        count = len(header.hashes)
        if header.shm_file:
            return self._store_from_file(header, count * block_bytes, block_bytes)
        if self.config.transport == "shm":
            raise ValueError("bytes over the socket, but this consumer takes shm files")
        if len(frames) != 1 or len(frames[0].buffer) != count * block_bytes:
            raise ValueError("the message's bytes do not match its header")
        raw = torch.frombuffer(frames[0].buffer, dtype=torch.uint8)
        blocks = raw.view(dtype).view(count, *shape)
        return self.buffer.put(header.hashes, blocks)

    def _discard_file(self, header: KVBlocksHeader) -> None:
        """Delete a refused message's shm file, if it is one this consumer reads."""
        match = SHM_NAME.fullmatch(header.shm_file)
        if self.config.transport == "shm" and match and int(match.group(2)) == self.port:
            _unlink(header.shm_file)

    def _store_from_file(
        self, header: KVBlocksHeader, nbytes: int, block_bytes: int
    ) -> tuple[list, list]:
        """Blocks from a producer's /dev/shm file: only a zllm-kv-* name for this consumer's
        port, only with the shm transport, only a file of this user (a peer must not point
        it at anything else)."""
        name = header.shm_file
        match = SHM_NAME.fullmatch(name)
        if self.config.transport != "shm" or match is None or int(match.group(2)) != self.port:
            raise ValueError(f"not a KV transfer file this consumer reads: {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            # Not through a link: /dev/shm is anyone's to write, and a link another user made
            # would lead to a file of ours (whose owner fstat then reports).
            with open(path, "rb", opener=_no_follow) as f:
                stat = os.fstat(f.fileno())
                if stat.st_uid != os.getuid():
                    raise ValueError(f"{path} belongs to another user")
                if stat.st_size != nbytes:
                    raise ValueError("the shared-memory file's size does not match its header")

                def read_block(i: int, target: torch.Tensor) -> None:
                    f.seek(i * block_bytes)
                    f.readinto(target.view(torch.uint8).numpy())

                return self.buffer.put(header.hashes, read_block)
        finally:
            _unlink(name)


class ForeignBlocks(ValueError):
    """Blocks of another model, weights or KV layout: the two servers are not a pair."""


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _shm_files() -> list[tuple[str, re.Match[str]]]:
    """The shm transport's files in SHM_DIR, each with its name's match of SHM_NAME."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [(name, match) for name in names if (match := SHM_NAME.fullmatch(name))]


def remove_orphaned_shm_files() -> None:
    """Delete the shm transport's files of producers that are no longer alive (a file is
    deleted by its consumer once read; these were never read)."""
    for name, match in _shm_files():
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _unlink(name)
        except PermissionError:
            pass  # another user's producer, alive


def remove_unread_shm_files(port: int) -> None:
    """Delete the shm transport's files for the consumer at `port` (of producers alive or
    not): called by the consumer that has just bound that port, before it reads any, so
    they are what a previous consumer there left unread when it died (a producer that lives
    on never deletes a file once sent). A file sent in the moment between the bind and this
    is deleted too: its blocks are then computed, as for any lost transfer."""
    for name, match in _shm_files():
        if int(match.group(2)) == port:
            _unlink(name)  # (another user's, in sticky /dev/shm, fails and stays)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, os.path.basename(name)))
    except OSError:
        pass
