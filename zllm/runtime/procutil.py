"""Small helpers every serving process uses at start: title, parent-death signal, ready report,
free ports."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable

import msgspec
import zmq

from zllm.config.serve import ServeConfig, decode_config
from zllm.protocol import ProcessReady, ProcessRole

_PR_SET_PDEATHSIG = 1
# Set by the supervisor on a worker it starts before the config exists: wait for its word.
HELD_ENV = "ZLLM_HELD_FOR_CONFIG"


def start_process(
    role: ProcessRole,
    index: int | None = None,
    index_of: Callable[[ServeConfig], int | None] | None = None,
) -> ServeConfig:
    """Read the config named on the command line, set the title, die with the parent.
    `index_of`: the index to title the process with, read from the config (an executor's
    rank, shown only when there are several). A core or executor rank of one of several
    data-parallel engines gets the engine's index as its third argument (`dp<engine>` in
    its title)."""
    die_with_parent()
    wait_for_config()
    with open(sys.argv[1], "rb") as f:
        config = decode_config(f.read())
    if len(sys.argv) > 3:
        config.engine_index = int(sys.argv[3])
    if index_of is not None:
        index = index_of(config)
    title = f"zllm: {role}" if index is None else f"zllm: {role} {index}"
    if role.is_engine and config.data_parallel_size > 1:
        title += f" dp{config.engine_index}"
    title_process(title)
    return config


def wait_for_config() -> None:
    """A worker the supervisor started beside the engine (so its imports overlap the model's
    load) waits for a line on stdin: its config, which needs the engine's KV pool size, is
    written. End of file instead: the supervisor gave up starting."""
    if os.environ.pop(HELD_ENV, None) is None:
        return
    if not sys.stdin.readline():
        sys.exit(1)


def title_process(title: str) -> None:
    """Set the process title (`zllm: <role> [i]`) and log lines tagged with the role."""
    import setproctitle

    setproctitle.setproctitle(title)
    logging.basicConfig(
        level=os.environ.get("ZLLM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{title[6:]}] %(name)s: %(message)s",
    )


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to signal us when the supervisor dies, so no child is ever orphaned."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def report_ready(
    config: ServeConfig, role: ProcessRole, index: int = 0, num_blocks: int = 0
) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(config.endpoints.supervisor_in)
    msg = ProcessReady(
        role=role,
        index=index,
        pid=os.getpid(),
        num_blocks=num_blocks,
        engine=config.engine_index,
    )
    sock.send(msgspec.msgpack.encode(msg))
    sock.close(linger=2000)


def index_arg() -> int:
    return int(sys.argv[2]) if len(sys.argv) > 2 else 0


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` ports free on `host` now (bound once by the OS, then let go): for sockets a
    process binds later (tcp endpoints, torch.distributed's rendezvous, a Ray head)."""
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((host, 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports
