"""The Ray cluster a data-parallel server's engines share (`--data-parallel-size N` with
`--distributed-executor-backend ray`).

Every engine's executor process (its Ray driver) joins one cluster: RAY_ADDRESS when set,
else a head node the supervisor starts here for the server's lifetime (`ray start --head
--block`, its ports chosen free). Not the first driver's local cluster: a driver that starts
one owns it, and that engine's restart (its driver exits) would take every other engine's
actors with it. Each driver still owns its own placement group and actors, so an engine's
death removes only its own.

Only the `ray` command runs here: the supervisor does not import Ray.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

from zllm.runtime.procutil import die_with_parent, free_ports

logger = logging.getLogger("zllm.runtime.supervisor")

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# `ray start` takes several seconds on a busy host (GCS, raylet, agents).
HEAD_START_TIMEOUT_S = 120.0


class RayHead:
    """A `ray start --head --block` child: its processes go when it goes (Ray's reaper), and
    it goes when the supervisor does (PDEATHSIG)."""

    def __init__(self, run_dir: str) -> None:
        gcs, client, agent = free_ports(3)
        self.address = f"127.0.0.1:{gcs}"
        self.log_path = os.path.join(run_dir, "ray-head.log")
        # Free ports for what would otherwise take fixed ones (another cluster on this host
        # may hold them); the rest Ray picks free itself.
        cmd = [
            _ray_command(), "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1", "--port", str(gcs),
            "--dashboard-agent-listen-port", str(agent), "--include-dashboard", "false",
        ]  # fmt: skip
        if importlib.util.find_spec("grpc") is not None:
            # Ray Client's server (port 10001) starts only where its grpc is installed, and
            # Ray refuses the option elsewhere.
            cmd += ["--ray-client-server-port", str(client)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        logger.info("started a Ray head node for the engines at %s", self.address)

    def wait_ready(self) -> None:
        """Until the head's GCS answers (the drivers' `ray.init` then finds it)."""
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        host, port = self.address.split(":")
        while not _accepts(host, int(port)) or "Ray runtime started" not in self._log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited: {self._log()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head node did not start in {HEAD_START_TIMEOUT_S} s")
            time.sleep(0.2)

    def dead(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """SIGTERM: `ray start --block` stops the processes it started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def needs_own_head(backend: str, engines: int) -> bool:
    """Whether the supervisor starts the engines' Ray head: several Ray engines and no
    cluster named (RAY_ADDRESS, which may be `auto`: a cluster running on this host)."""
    return backend == "ray" and engines > 1 and not os.environ.get(RAY_ADDRESS_ENV)


def _ray_command() -> str:
    """The `ray` script beside this Python (a venv's bin), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.path.exists(beside) else (shutil.which("ray") or "ray")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
