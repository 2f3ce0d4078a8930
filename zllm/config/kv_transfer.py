"""`--kv-transfer-config`: prefill/decode disaggregation, in vLLM's shape (no torch).

    {"kv_connector": "ZllmConnector", "kv_role": "kv_producer" | "kv_consumer",
     "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_buffer_size": 1e9,
     "kv_connector_extra_config": {"transport": "tcp" | "shm", "wait_timeout_s": 5.0,
                                   "consumer_data_parallel_size": 1}}

A producer (the prefill instance) sends the KV blocks of each prompt it computes for a
request marked `kv_transfer_params: {"do_remote_decode": true}` to the consumer at
kv_ip:kv_port, keyed by block hash (zllm/kv/block_hash.py: the same in every process). A
consumer (the decode instance) listens there, keeps what arrives in a buffer of
kv_buffer_size bytes, and admits a request marked `{"do_remote_prefill": true}` once its
prompt's blocks are in (or after wait_timeout_s): they are then prefix-cache hits, loaded
from the buffer. What never arrives is computed, so a lost transfer costs time, never a
wrong answer. `transport` "shm" moves the bytes through shared memory (both on one host),
"tcp" through the socket.

With --tensor-parallel-size T and --pipeline-parallel-size P (the same on both servers) each
of the N = P x T executor ranks moves its own part of a block (its KV heads of its stage's
layers): producer rank r (stage x T + tensor-parallel rank) sends to consumer rank r, which
listens at kv_port + r, so a consumer takes the ports kv_port .. kv_port + N - 1
(`rank_address`).

With --data-parallel-size D on the consumer, each of its engines has its own executors and
buffers, so each listens on its own ports: engine e's rank r at kv_port + e x N + r (the
consumer takes kv_port .. kv_port + D x N - 1: `engine_address`). A request's blocks must
reach the engine that serves it, and neither server can ask the other which one that is,
so both compute it from the prompt (`consumer_engine`): its first full block's hash (which
holds the request's salt) modulo D. The consumer's tokenizer workers route a request marked
do_remote_prefill there, whatever its prefix affinity; the producer's core names that engine
for each request's blocks. So the producer must know D: `consumer_data_parallel_size` in
its kv_connector_extra_config (default 1; a consumer's own D is its --data-parallel-size,
which the key, if a consumer gives it, must equal). It is the producer's to say because the
config is static and one-way (nothing flows from the consumer to the producer to learn it
from), and the ports follow from it. A data-parallel producer needs nothing more: each of
its engines sends what it prefilled.

`zllm proxy` (zllm/proxy/app.py) sends each request to a producer with max_tokens 1
and then to a consumer, marking both.

(vLLM's `kv_both`, an engine that is both, is not offered: a producer sends to the one
consumer address it is given.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zllm.config.arg_utils import check_config_dict
from zllm.kv.block_hash import key_to_int

CONNECTOR_NAME = "ZllmConnector"
ROLES = ("kv_producer", "kv_consumer")
TRANSPORTS = ("tcp", "shm")
_KEYS = {
    "kv_connector",
    "kv_role",
    "kv_ip",
    "kv_port",
    "kv_buffer_size",
    "kv_connector_extra_config",
    # vLLM fields that mean nothing here but which its example configs carry.
    "kv_rank",
    "kv_parallel_size",
    "kv_buffer_device",
    "engine_id",
}
_EXTRA_KEYS = {"transport", "wait_timeout_s", "consumer_data_parallel_size"}


@dataclass(slots=True)
class KVTransferConfig:
    role: str  # one of ROLES
    host: str = "127.0.0.1"  # the consumer's address: it binds, producers connect
    port: int = 14579
    buffer_bytes: int = 1 << 30  # the consumer's buffer of received blocks
    transport: str = "tcp"
    wait_timeout_s: float = 5.0  # how long a consumer holds a request for its blocks
    # The consumer's data-parallel engines (a producer's extra config names it; a consumer's
    # is its --data-parallel-size, set by serve_config_from).
    consumer_engines: int = 1

    @property
    def produces(self) -> bool:
        return self.role == "kv_producer"

    @property
    def consumes(self) -> bool:
        return self.role == "kv_consumer"

    @property
    def address(self) -> str:
        return self.rank_address(0)

    def rank_address(self, rank: int) -> str:
        """Where executor rank `rank`'s blocks go (a consumer of one engine): each rank
        has its own channel to its peer rank, so the parts of a block never need to meet in
        one process."""
        return self.engine_address(0, rank, rank + 1)

    def engine_address(self, engine: int, rank: int, ranks: int) -> str:
        """Where the consumer's data-parallel engine `engine`'s rank `rank` (of `ranks` per
        engine) listens: each engine's executors keep their own buffer."""
        return f"tcp://{self.host}:{self.engine_port(engine, rank, ranks)}"

    def engine_port(self, engine: int, rank: int, ranks: int) -> int:
        """`engine_address`'s port (which also names the shm transport's files for it)."""
        return self.port + engine * ranks + rank


def consumer_engine(block_hashes: Sequence[bytes], engines: int) -> int | None:
    """The consumer engine that serves a prompt with these full-block hashes, and so gets its
    blocks: both servers compute it alike (the hashes are the same in every process, and
    the first holds the request's salt). None: no full block, nothing to send."""
    if not block_hashes:
        return None
    return key_to_int(block_hashes[0]) % engines


def check_ports(
    config: KVTransferConfig, ranks: int, engines: int = 1, server_port: int | None = None
) -> None:
    """Refuse a port range (kv_port + engine x ranks + rank, for each engine and rank) that
    is not all ports, or that takes the server's own HTTP port (a consumer binds them all on
    its host; a producer connects to them)."""
    last = config.port + engines * ranks - 1
    layout = f"{ranks} executor ranks" + (f" x {engines} engines" if engines > 1 else "")
    if last > 65535:
        raise ValueError(
            f"kv_transfer_config: kv_port {config.port} with {layout} needs ports "
            f"{config.port}-{last} (engine e's rank r at kv_port + e x ranks + r), past 65535"
        )
    if server_port is not None and config.port <= server_port <= last:
        raise ValueError(
            f"kv_transfer_config: the KV ports {config.port}-{last} (kv_port + each "
            f"executor rank of each engine) take the server's --port {server_port}"
        )


def kv_transfer_config_from(value: dict[str, Any] | None) -> KVTransferConfig | None:
    """Check the user's dict; a ValueError naming what is off."""
    if value is None:
        return None
    check_config_dict("kv_transfer_config", value, _KEYS)
    connector = value.get("kv_connector", CONNECTOR_NAME)
    if connector != CONNECTOR_NAME:
        raise ValueError(
            f"kv_transfer_config: kv_connector {connector!r} is not available here; "
            f"zllm's is {CONNECTOR_NAME!r}"
        )
    role = value.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(ROLES)}")
    extra = check_config_dict(
        "kv_transfer_config: kv_connector_extra_config",
        value.get("kv_connector_extra_config") or {},
        _EXTRA_KEYS,
    )
    config = KVTransferConfig(
        role=role,
        host=str(value.get("kv_ip", "127.0.0.1")),
        port=_int(value, "kv_port", 14579),
        buffer_bytes=_int(value, "kv_buffer_size", 1 << 30),
        transport=str(extra.get("transport", "tcp")),
        wait_timeout_s=_number(extra, "wait_timeout_s", 5.0),
        consumer_engines=_int(extra, "consumer_data_parallel_size", 1),
    )
    if not 0 < config.port < 65536:
        raise ValueError(f"kv_transfer_config: kv_port {config.port} is not a port")
    if config.transport not in TRANSPORTS:
        raise ValueError(f"kv_transfer_config: transport must be one of {', '.join(TRANSPORTS)}")
    if config.consumer_engines < 1:
        raise ValueError("kv_transfer_config: consumer_data_parallel_size must be at least 1")
    if config.wait_timeout_s < 0:
        raise ValueError("kv_transfer_config: wait_timeout_s must be at least 0")
    if config.transport == "shm" and not _is_local(config.host):
        raise ValueError(
            f"kv_transfer_config: transport shm moves blocks through this host's /dev/shm, "
            f"but kv_ip {config.host} is not an address of this host: use tcp"
        )
    return config


def _is_local(host: str) -> bool:
    """Whether `host` is one of this machine's addresses (a socket can bind to it)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def _number(value: dict[str, Any], key: str, default: float) -> float:
    raw = value.get(key, default)
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"kv_transfer_config: {key} must be a number, got {raw!r}") from None


def _int(value: dict[str, Any], key: str, default: int) -> int:
    raw = value.get(key, default)
    number = _number(value, key, default)  # (a float: vLLM writes kv_buffer_size as 1e9)
    if number != int(number) or number < 0:
        raise ValueError(f"kv_transfer_config: {key} must be a whole number, got {raw!r}")
    return int(number)
