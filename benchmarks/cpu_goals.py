"""Issue 37's goals as one markdown table, from the results benchmarks/cpu_goals.sh writes:
each goal's figures, their ratio and whether it is met. A part that did not run (or whose
server failed) shows as "not measured".

    python benchmarks/cpu_goals.py GOALS_DIR > goals.md
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

ZLLM_RUNS = ("zllm", "zllm-gguf-int8")  # the default float kernel, llama.cpp's arithmetic


@dataclass(frozen=True, slots=True)
class Row:
    goal: str
    measured: str
    ratio: float | None
    met: bool | None


class Results:
    """The JSON files under one goals directory."""

    def __init__(self, root: str):
        self.root = root

    def json(self, name: str) -> dict | None:
        path = os.path.join(self.root, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text) if text else None

    def serve(self, part: str, label: str, concurrency: int) -> dict | None:
        """One `zllm bench serve` cell: engine `label` at `concurrency` in run `part`."""
        for path in glob.glob(
            os.path.join(self.root, part, f"serve-{label}-in*-c{concurrency}.json")
        ):
            with open(path) as f:
                cell = json.load(f)
            if cell.get("label") == label and cell.get("completed"):
                return cell
        return None


def _ratio_row(
    goal: str, ours: float | None, theirs: float | None, what: str, met: Callable[[float], bool]
) -> Row:
    if ours is None or theirs is None:
        return Row(goal, "not measured", None, None)
    ratio = ours / theirs
    return Row(goal, f"{what}: {ours:.1f} / {theirs:.1f}", ratio, met(ratio))


def _field(cell: dict | None, key: str, stat: str | None = "p50") -> float | None:
    if cell is None:
        return None
    return cell[key][stat] if stat else cell[key]


def _best_peer(
    results: Results, part: str, labels: tuple[str, ...], c: int
) -> tuple[str, float | None]:
    """The llama-server format with the most output tok/s at concurrency c."""
    best = ("-", None)
    for label in labels:
        rate = _field(results.serve(part, label, c), "output_throughput", None)
        if rate is not None and (best[1] is None or rate > best[1]):
            best = (label, rate)
    return best


def _per_run(
    r: Results,
    part: str,
    c: int,
    key: str,
    peer: tuple[str, float | None],
    goal: str,
    what: str,
    met: Callable[[float], bool],
) -> list[Row]:
    """One row per zllm configuration: its `key` figure at concurrency c against the peer's
    (`goal` names the configuration where it says {run}, the peer where it says {peer})."""
    stat = None if key == "output_throughput" else "p50"
    return [
        _ratio_row(
            goal.format(run=run, peer=peer[0]),
            _field(r.serve(part, run, c), key, stat),
            peer[1],
            what,
            met,
        )
        for run in ZLLM_RUNS
    ]


def _p50(r: Results, part: str, label: str, key: str) -> tuple[str, float | None]:
    return label, _field(r.serve(part, label, 1), key)


def llama1b_rows(r: Results) -> list[Row]:
    q4 = "llama.cpp-Q4_K_M"
    rows = _per_run(
        r,
        "llama1b",
        1,
        "tpot_ms",
        _p50(r, "llama1b", q4, "tpot_ms"),
        "1B Q4_K_M c=1 TPOT <= 0.9x llama-server ({run})",
        "TPOT p50 ms",
        lambda x: x <= 0.9,
    )
    for part, c in (("llama1b", 8), ("llama1b-c32", 32)):
        rows += _per_run(
            r,
            part,
            c,
            "output_throughput",
            _best_peer(r, part, (q4, "llama.cpp-Q8_0"), c),
            f"1B c={c} output tok/s >= 1.5x llama-server's best ({{run}} vs {{peer}})",
            "tok/s",
            lambda x: x >= 1.5,
        )
    rows += _per_run(
        r,
        "prefill",
        1,
        "ttft_ms",
        _p50(r, "prefill", q4, "ttft_ms"),
        "1B 1,024-token prompt, c=1 TTFT <= llama-server ({run})",
        "TTFT p50 ms",
        lambda x: x <= 1.0,
    )
    return rows


def floor_rows(r: Results) -> list[Row]:
    floor = r.json("floor.json")
    rows = []
    for run in ZLLM_RUNS:
        ours = _field(r.serve("llama1b", run, 1), "tpot_ms")
        row = _ratio_row(
            f"1B c=1 TPOT within 1.25x of the floor ({run})",
            ours,
            floor and floor["floor_ms"],
            "TPOT / floor ms",
            lambda x: x <= 1.25,
        )
        if floor and row.ratio is not None:
            row = Row(
                row.goal, f"{row.measured} ({floor['read_gb_per_s']} GB/s read)", row.ratio, row.met
            )
        rows.append(row)
    return rows


def memory_rows(r: Results) -> list[Row]:
    rows = []
    for name in ("llama1b-Q4_K_M.gguf", "llama1b-F16.gguf", "hf-bf16"):
        m = r.json(f"memory-{name}.json")
        if m is None:
            rows.append(
                Row(
                    f"RSS after load <= file + KV pool + 150 MB ({name})",
                    "not measured",
                    None,
                    None,
                )
            )
            continue
        over = (m["after"] - m["before"] - m["weights_bytes"] - m["pool_bytes"]) / 1e6
        rows.append(
            Row(
                f"RSS after load <= file + KV pool + 150 MB ({name}, {m['method']})",
                f"grew {(m['after'] - m['before']) / 1e6:.0f} MB, {over:+.0f} MB over file + pool",
                None,
                over <= 150,
            )
        )
    start = r.json("startup.json")
    ours, theirs = (
        (start["zllm"]["median_s"], start["llama-server"]["median_s"]) if start else (None, None)
    )
    rows.append(
        _ratio_row(
            "start-up to /health <= llama-server's (1B Q4_K_M)",
            ours,
            theirs,
            "median s",
            lambda x: x <= 1.0,
        )
    )
    return rows


def smollm2_rows(r: Results) -> list[Row]:
    rows = _per_run(
        r,
        "smollm2",
        1,
        "tpot_ms",
        _p50(r, "smollm2", "llama.cpp-Q4_1", "tpot_ms"),
        "SmolLM2 c=1 TPOT <= llama-server Q4_1 ({run})",
        "TPOT p50 ms",
        lambda x: x <= 1.0,
    )
    for c in (8, 32):
        rows += _per_run(
            r,
            "smollm2",
            c,
            "output_throughput",
            _best_peer(r, "smollm2", ("llama.cpp-Q4_1", "llama.cpp-F16"), c),
            f"SmolLM2 c={c} output tok/s >= 1.5x the better llama format ({{run}} vs {{peer}})",
            "tok/s",
            lambda x: x >= 1.5,
        )
    return rows


def sixteen_bit_rows(r: Results) -> list[Row]:
    peer = _field(r.serve("16bit", "llama.cpp-F16", 1), "tpot_ms")
    return [
        _ratio_row(
            f"1B 16-bit c=1 TPOT <= llama-server F16 ({label})",
            _field(r.serve("16bit", label, 1), "tpot_ms"),
            peer,
            "TPOT p50 ms",
            lambda x: x <= 1.0,
        )
        for label in ("zllm-bf16", "zllm-F16")
    ]


def arithmetic_rows(r: Results) -> list[Row]:
    logits = r.json("logits.json")
    if logits is None:
        rows = [Row("1B bf16 logits against transformers (KL, argmax)", "not measured", None, None)]
    else:
        rows = [
            Row(
                "1B bf16 logits against transformers (KL, argmax)",
                f"max |diff| {logits['max_abs_logit_diff']['max']:.2e}, KL max {logits['kl']['max']:.2e}, "
                f"argmax {logits['argmax_agree']:.1%} of {logits['positions']}",
                None,
                logits["kl"]["max"] < 1e-4 and logits["argmax_agree"] >= 0.99,
            )
        ]
    fp32, int8 = r.json("kv-auto.json"), r.json("kv-int8.json")
    rows.append(
        _ratio_row(
            "int8 KV >= 1.3x fp32 KV, 4K context, c=8 (SmolLM2)",
            fp32 and fp32["step_ms"],
            int8 and int8["step_ms"],
            "step ms, fp32 / int8",
            lambda x: x >= 1.3,
        )
    )
    return rows


def header(r: Results) -> list[str]:
    meta = r.json("llama1b/meta.json") or r.json("smollm2/meta.json") or {}
    return [
        f"# Issue 37's goals, {meta.get('date', '?')}",
        "",
        f"Machine: {meta.get('cpu', '?')}, {meta.get('nproc', '?')} CPUs; torch {meta.get('torch')}; "
        f"zllm commit {meta.get('zllm_commit')}; {meta.get('llama_cpp', '')}. Results: `{r.root}`.",
        "",
        "| goal | measured | ratio | met? |",
        "|---|---|---|---|",
    ]


def main() -> int:
    results = Results(sys.argv[1])
    rows = [
        *llama1b_rows(results),
        *floor_rows(results),
        *memory_rows(results),
        *smollm2_rows(results),
        *sixteen_bit_rows(results),
        *arithmetic_rows(results),
    ]
    lines = header(results)
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        met = "-" if row.met is None else ("yes" if row.met else "no")
        lines.append(f"| {row.goal} | {row.measured} | {ratio} | {met} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
