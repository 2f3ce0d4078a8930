"""The executor's side of the KV tiers: the bytes of the blocks the core's index names
(core/kv/connector.py decides what moves; this file moves it).

A block's bytes, as a tier keeps them, are every KV tensor's slice for that block id, one
tensor per layer of the (single) KV cache group, and a draft model's layers' beside them
under the same key (executor/kv/pool.py)::

    block  [layers, 2 (K, V), block_size, kv_heads, head_dim]     model dtype, on the CPU
           [nbytes] uint8 with a draft model: the target's part, then the draft's

Each step's `KVTransfers` are applied before its forward, in the order drops, stores, loads
(`KVTiers.apply`): stores read pool blocks the step is about to reuse, loads fill the newly
allocated ones. A tier is the executor side of a `KVConnector`: `store(block_hashes,
block_ids)` copies pool blocks in, `load(block_hashes, block_ids)` copies them back and says
which it could not, `drop(block_hashes)` forgets them.

    CpuTier    a slot buffer of --kv-offload-bytes (pinned memory on a GPU), slots on demand
    DiskTier   one file per block under --kv-offload-dir/<layout fingerprint>/, written by a
               background thread (so disk writes overlap the model's compute) through a
               temporary name and a rename; each file carries its hash, size and an
               HMAC-SHA256 of header and bytes under a key kept outside the directory
               (zllm/kv/tier_key.py), checked on load: a missing, short, corrupt or edited
               file is a failed load, removed, which the model runner recomputes (never
               wrong output)
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import queue
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from zllm.config.engine import EngineConfig
from zllm.config.kv_layout import block_bytes, tier_directory
from zllm.executor.kv.pool import KVPool
from zllm.kv.block_hash import BlockHash
from zllm.kv.tier_key import read_key
from zllm.kv.tiers import FILE_FORMAT_VERSION, TIER_CPU, TIER_DISK, TIER_REMOTE, block_file_name
from zllm.protocol import KVTransfers

logger = logging.getLogger(__name__)

# A block file: this header, then the block's bytes. The MAC covers the header before it and
# the bytes: HMAC-SHA256 under the tier's key.
_HEADER = struct.Struct("<4sI16sQ32s")  # magic, format version, block hash, payload bytes, MAC
_MACED = _HEADER.size - 32  # the header bytes the MAC covers
_MAGIC = b"ZKV\x00"
# Evicted blocks held in memory while the disk tier's writer catches up, at most (issue 56:
# a disk slower than the evictions grew this queue without bound).
MAX_PENDING_BYTES = 256 << 20


class KVTier(Protocol):
    """The executor side of a KV connector."""

    def store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None: ...

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[int]:
        """Copy the blocks into the pool; returns the indexes (into the arguments) of those
        it could not load."""
        ...

    def drop(self, block_hashes: Sequence[BlockHash]) -> None: ...


class CpuTier:
    """Blocks in the executor's memory: one buffer of `capacity` block slots (allocated
    untouched, so its pages become resident as slots are first used)."""

    def __init__(self, pool: KVPool, capacity: int, pin_memory: bool) -> None:
        self.pool = pool
        self.buffer = torch.empty(
            (capacity, *pool.block_shape), dtype=pool.block_dtype, pin_memory=pin_memory
        )
        self.slots: dict[BlockHash, int] = {}
        self.free_slots = list(range(capacity - 1, -1, -1))

    def store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        new = [(h, b) for h, b in zip(block_hashes, block_ids, strict=True) if h not in self.slots]
        if not new:
            return
        if len(new) > len(self.free_slots):
            raise RuntimeError("KV cpu tier: the core stored more blocks than it holds")
        slots = [self.free_slots.pop() for _ in new]
        self.buffer[slots] = self.pool.gather([b for _, b in new])
        self.slots.update((h, s) for (h, _), s in zip(new, slots, strict=True))

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[int]:
        found = [i for i, h in enumerate(block_hashes) if h in self.slots]
        if found:
            slots = [self.slots[block_hashes[i]] for i in found]
            self.pool.scatter([block_ids[i] for i in found], self.buffer[slots])
        return [i for i, h in enumerate(block_hashes) if h not in self.slots]

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            slot = self.slots.pop(block_hash, None)
            if slot is not None:
                self.free_slots.append(slot)


class DiskTier:
    """Blocks as files; writes in a background thread, loads checked against their MAC."""

    def __init__(
        self,
        pool: KVPool,
        directory: Path,
        block_nbytes: int,
        key: bytes,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        """The blocks the directory holds stay: their hashes name the same tokens under the
        same salts after a restart (an adapter's salt is its files' digest, lora.py), and
        their MACs check under the same key. At most `max_pending_bytes` of blocks wait in
        memory for the writer (at least one block)."""
        self.pool = pool
        self.max_pending = max(1, max_pending_bytes // block_nbytes)
        self._dropping = False  # stores are being dropped (logged once per spell)
        self.directory = directory
        self.block_nbytes = block_nbytes
        self._key = key
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(directory / ".lock", "w")  # held (locked) for the tier's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            raise RuntimeError(
                f"--kv-offload-dir {directory.parent}: another engine uses {directory} "
                "(one engine per directory and model)"
            ) from e
        for path in directory.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write a crash cut short
        # Stored but not yet on disk: a load finds them here.
        self._pending: dict[BlockHash, torch.Tensor] = {}
        self._pending_lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[str, BlockHash, torch.Tensor | None]] = (
            queue.SimpleQueue()
        )
        self._flushed = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
        self._writer.start()

    def store(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Queue the blocks for writing; past `max_pending` waiting, the rest are not
        written (a later load misses them and they are recomputed), so a disk slower than
        the evictions cannot grow memory."""
        with self._pending_lock:
            room = max(0, self.max_pending - len(self._pending))
        if room < len(block_hashes) and not self._dropping:
            logger.warning(
                "KV disk tier: %d blocks wait for the disk (its bound); not storing more "
                "until it catches up",
                self.max_pending,
            )
        self._dropping = room < len(block_hashes)
        block_hashes, block_ids = block_hashes[:room], block_ids[:room]
        if not block_hashes:
            return
        blocks = list(self.pool.gather(block_ids))  # one tensor object per block: the
        with self._pending_lock:  # writer drops it from _pending by identity
            for block_hash, block in zip(block_hashes, blocks, strict=True):
                self._pending[block_hash] = block
        for block_hash, block in zip(block_hashes, blocks, strict=True):
            self._queue.put(("write", block_hash, block))

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[int]:
        failed, good_ids, good_blocks = [], [], []
        for i, block_hash in enumerate(block_hashes):
            with self._pending_lock:
                block = self._pending.get(block_hash)
            if block is None:
                block = self._read(block_hash)
            if block is None:
                failed.append(i)
            else:
                good_ids.append(block_ids[i])
                good_blocks.append(block)
        if good_ids:
            self.pool.scatter(good_ids, torch.stack(good_blocks))
        return failed

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            with self._pending_lock:
                self._pending.pop(block_hash, None)
            self._queue.put(("delete", block_hash, None))

    def flush(self) -> None:
        """Wait until every write and delete queued so far is done (tests, benchmarks)."""
        self._flushed.clear()
        self._queue.put(("flush", 0, None))
        self._flushed.wait()

    # ---- files -------------------------------------------------------------------------------
    def path_of(self, block_hash: BlockHash) -> Path:
        return self.directory / block_file_name(block_hash)

    def _read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block from its file, or None (logged) if it is missing or does not check."""
        path = self.path_of(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            logger.warning("KV disk tier: block %s is missing; recomputing it", path.name)
            return None
        why = self._check(data, block_hash)
        if why is not None:
            logger.warning("KV disk tier: block %s %s; removed, recomputing it", path.name, why)
            path.unlink(missing_ok=True)
            return None
        payload = bytearray(data[_HEADER.size :])
        dtype = self.pool.block_dtype
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(self.pool.block_shape)

    def _check(self, data: bytes, block_hash: BlockHash) -> str | None:
        if len(data) < _HEADER.size:
            return "is truncated"
        magic, version, stored_hash, nbytes, mac = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != FILE_FORMAT_VERSION or stored_hash != block_hash:
            return "is not this block"
        if nbytes != self.block_nbytes or len(data) - _HEADER.size != nbytes:
            return "has the wrong size"
        view = memoryview(data)
        if not hmac.compare_digest(self._mac(view[:_MACED], view[_HEADER.size :]), mac):
            return "fails its authentication (edited, damaged, or written under another key)"
        return None

    def _mac(self, header: memoryview | bytes, payload) -> bytes:
        mac = hmac.new(self._key, header, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def _write_loop(self) -> None:
        while True:
            op, block_hash, block = self._queue.get()
            try:
                if op == "write":
                    assert block is not None
                    self._write(block_hash, block)
                elif op == "delete":
                    self.path_of(block_hash).unlink(missing_ok=True)
                else:
                    self._flushed.set()
            except OSError as e:  # a full disk: the block is simply not there later
                logger.warning("KV disk tier: %s of %s failed: %s", op, block_hash.hex(), e)
            finally:
                if op == "write":
                    with self._pending_lock:
                        if self._pending.get(block_hash) is block:
                            del self._pending[block_hash]

    def _write(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy()
        fields = (_MAGIC, FILE_FORMAT_VERSION, block_hash, payload.nbytes)
        prefix = _HEADER.pack(*fields, b"\0" * 32)[:_MACED]
        header = _HEADER.pack(*fields, self._mac(prefix, payload))
        path = self.path_of(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)


class KVTiers:
    """The tiers this engine has, and each step's transfers applied to them."""

    def __init__(self, config: EngineConfig, pool: KVPool, rank: int = 0) -> None:
        """`rank`: this executor rank (stage x tensor-parallel size + tensor-parallel rank:
        its disk tier directory); each tier holds as many blocks as the core counts, each at
        this rank's part of a block's bytes (its KV heads of its stage's layers)."""
        offload = config.kv_offload
        nbytes = block_bytes(config)  # a whole block: the core's unit for the tiers' bounds
        pin = pool.tensors[0].is_cuda
        self.tiers: list[KVTier | None] = [None, None, None]
        if offload is not None and offload.cpu_bytes > 0:
            self.tiers[TIER_CPU] = CpuTier(pool, offload.cpu_bytes // nbytes, pin)
        if offload is not None and offload.disk_dir is not None:
            directory = tier_directory(config, rank)
            if offload.key_file is None:
                raise ValueError("the KV disk tier needs its key file (kv_offload.key_file)")
            key = read_key(offload.key_file)
            self.tiers[TIER_DISK] = DiskTier(pool, directory, pool.block_nbytes, key)
        transfer = config.kv_transfer
        if transfer is not None and transfer.consumes:  # what a prefill instance sends
            from zllm.executor.kv.transfer import RemoteKVBuffer

            self.tiers[TIER_REMOTE] = RemoteKVBuffer(pool, transfer.buffer_bytes // nbytes, pin)

    @property
    def remote(self):
        """The disaggregation consumer's buffer of received blocks (None: not a consumer)."""
        return self.tiers[TIER_REMOTE]

    def apply(self, transfers: KVTransfers) -> list[tuple[int, BlockHash, int]]:
        """Drops, stores, loads; returns the (tier, hash, block id) loads that failed."""
        for tier, hashes, _ in _by_tier([(t, h, 0) for t, h in transfers.drops]):
            self._tier(tier).drop(hashes)
        for tier, hashes, ids in _by_tier(transfers.stores):
            self._tier(tier).store(hashes, ids)
        failed: list[tuple[int, BlockHash, int]] = []
        for tier, hashes, ids in _by_tier(transfers.loads):
            for i in self._tier(tier).load(hashes, ids):
                failed.append((tier, hashes[i], ids[i]))
        return failed

    def _tier(self, tier: int) -> KVTier:
        found = self.tiers[tier]
        if found is None:
            raise RuntimeError(f"KV transfer for tier {tier}, which this executor does not have")
        return found


def _by_tier(
    items: Sequence[tuple[int, BlockHash, int]],
) -> list[tuple[int, list[BlockHash], list[int]]]:
    """(tier, hash, block id) records grouped by tier, in order."""
    grouped: dict[int, tuple[list[BlockHash], list[int]]] = {}
    for tier, block_hash, block_id in items:
        hashes, ids = grouped.setdefault(tier, ([], []))
        hashes.append(block_hash)
        ids.append(block_id)
    return [(tier, hashes, ids) for tier, (hashes, ids) in grouped.items()]
