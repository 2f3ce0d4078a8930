"""What a `zllm bench serve` run cost on the server side, for a zllm server on this machine.

Two snapshots, before and after the timed requests, of:
- the server's /metrics step counters (zllm:executor_*_seconds_total, zllm:core_*_seconds_total,
  zllm:engine_steps_total): where each step's time went, and the executor's idle share, the
  time it waited for the core between steps (the overlap the multi-process design exists for);
- with pipeline stages, each stage's busy and idle seconds (zllm:pipeline_stage_*): its idle
  share is the pipeline's bubble at that stage;
- the CPU time (user + system, from /proc) of every local process titled `zllm: <role> ...`:
  what each role costs per generated token. On 2 cores every cycle another process uses is
  one the executor's matmuls don't get.

Neither needs anything from the server beyond what it already exports; against another
engine (llama-server) both simply come back empty.
"""

from __future__ import annotations

import os
import re
from typing import Any

STEP_COUNTERS = {
    "steps": "zllm:engine_steps_total",
    "busy": "zllm:executor_busy_seconds_total",
    "idle": "zllm:executor_idle_seconds_total",
    "prepare": "zllm:executor_prepare_seconds_total",
    "forward": "zllm:executor_forward_seconds_total",
    "sample": "zllm:executor_sample_seconds_total",
    "schedule": "zllm:core_schedule_seconds_total",
    "core_output": "zllm:core_output_seconds_total",
    "gpu_idle": "zllm:gpu_idle_seconds_total",
    "overlapped": "zllm:executor_overlapped_steps_total",
}


# Speculative decoding (a zllm or vLLM server that speculates): acceptance over the run.
SPEC_COUNTERS = {
    "spec_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_accepted": "vllm:spec_decode_num_accepted_tokens_total",
}


# Pipeline parallel, per stage (the key gets ":<stage>").
STAGE_COUNTERS = {
    "stage_busy": "zllm:pipeline_stage_busy_seconds_total",
    "stage_idle": "zllm:pipeline_stage_idle_seconds_total",
}


def parse_counters(metrics_text: str) -> dict[str, float]:
    """Prometheus text -> {our key: value} for STEP_COUNTERS and SPEC_COUNTERS (summed over
    label sets), and STAGE_COUNTERS per stage ("stage_idle:0", ...)."""
    by_name = {name: key for key, name in {**STEP_COUNTERS, **SPEC_COUNTERS}.items()}
    per_stage = {name: key for key, name in STAGE_COUNTERS.items()}
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = by_name.get(name)
        if key is None and name in per_stage:
            stage = re.search(r'stage="(\d+)"', line)
            key = f"{per_stage[name]}:{stage.group(1)}" if stage else None
        if key is not None:
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def process_cpu_seconds(parent: int | None = None, per_process: bool = False) -> dict[str, float]:
    """CPU seconds so far of each local `zllm: <role> [index]` process, summed per role;
    `parent`: only the children of that process (one server's, where several run);
    `per_process`: one entry per process, keyed `role:pid` (engine_cost's snapshots: a
    process that ends between two of them must not subtract its time from its role's)."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_role: dict[str, float] = {}
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return by_role
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0", 1)[0].decode(errors="replace")
            if not title.startswith("zllm: "):
                continue
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the ")" closing the command name; utime and stime are 14, 15.
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if parent is not None and int(fields[1]) != parent:  # field 4, the parent's pid
            continue
        role = title[len("zllm: ") :].split()[0]
        key = f"{role}:{pid}" if per_process else role
        by_role[key] = by_role.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_role


def _cpu_spent_per_role(cpu0: dict[str, float], cpu1: dict[str, float]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots, keyed by role or by `role:pid`.
    Per process, only those in both count: one that ended meanwhile (another server's on the
    same machine, a restarted child) is unreadable after, one that started is not all inside
    the window; summed per role, an ended process made its role's total go backwards."""
    per_role: dict[str, float] = {}
    for key in sorted(cpu1):
        if ":" in key and key not in cpu0:
            continue
        role = key.split(":", 1)[0]
        per_role[role] = per_role.get(role, 0.0) + cpu1[key] - cpu0.get(key, 0.0)
    return per_role


def engine_cost(
    before: tuple[dict[str, float], dict[str, float]],
    after: tuple[dict[str, float], dict[str, float]],
    output_tokens: int,
) -> dict[str, Any] | None:
    """The per-step split and per-token CPU costs between two (counters, cpu) snapshots."""
    (c0, cpu0), (c1, cpu1) = before, after
    result: dict[str, Any] = {}
    steps = c1.get("steps", 0.0) - c0.get("steps", 0.0)
    if steps > 0:
        delta = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in STEP_COUNTERS if k != "steps"}
        overlapped = delta.pop("overlapped")  # (a count, not seconds)
        busy_idle = delta["busy"] + delta["idle"]
        result["steps"] = int(steps)
        result["overlapped_share"] = round(overlapped / steps, 4)
        result["per_step_ms"] = {k: round(v / steps * 1e3, 3) for k, v in delta.items()}
        result["executor_idle_share"] = round(delta["idle"] / busy_idle, 4) if busy_idle else None
        if delta.get("gpu_idle") and busy_idle:  # a GPU: its own idle share between steps
            result["gpu_idle_share"] = round(delta["gpu_idle"] / busy_idle, 4)
    stages = sorted(int(k.split(":")[1]) for k in c1 if k.startswith("stage_busy:"))
    if stages:
        shares = []
        for stage in stages:
            busy = c1[f"stage_busy:{stage}"] - c0.get(f"stage_busy:{stage}", 0.0)
            idle = c1.get(f"stage_idle:{stage}", 0.0) - c0.get(f"stage_idle:{stage}", 0.0)
            shares.append(round(idle / (busy + idle), 4) if busy + idle > 0 else None)
        result["pipeline_stage_idle_share"] = shares
    drafts = c1.get("spec_drafts", 0.0) - c0.get("spec_drafts", 0.0)
    if drafts > 0:
        proposed = c1.get("spec_draft_tokens", 0.0) - c0.get("spec_draft_tokens", 0.0)
        accepted = c1.get("spec_accepted", 0.0) - c0.get("spec_accepted", 0.0)
        result["spec_decode"] = {
            "drafts": int(drafts),
            "draft_tokens": int(proposed),
            "accepted_tokens": int(accepted),
            "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
            "mean_acceptance_length": round(1 + accepted / drafts, 3),
        }
    if cpu1 and output_tokens > 0:
        per_role = _cpu_spent_per_role(cpu0, cpu1)
        others = sum(v for r, v in per_role.items() if r != "executor")
        result["cpu_ms_per_output_token"] = {
            r: round(v / output_tokens * 1e3, 3) for r, v in per_role.items()
        }
        result["cpu_ms_per_output_token"]["all_but_executor"] = round(
            others / output_tokens * 1e3, 3
        )
    return result or None
