"""benchmarks/serve_parity.py's verdict: how a GPU server's greedy answer is judged against
the CPU engine's recorded one (equal, a near-tie flip, or a divergence)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "serve_parity", Path(__file__).resolve().parents[2] / "benchmarks" / "serve_parity.py"
)
serve_parity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_parity)


def answer(tokens: list[str], top: list[dict[str, float]]) -> dict:
    return {"prompt": "p", "tokens": tokens, "top": top}


REFERENCE = answer(
    ["Paris", " is", " nice"],
    [{"Paris": -0.1}, {" is": -0.50, " was": -0.52}, {" nice": -0.2, " big": -1.5}],
)


def test_the_same_tokens_are_equal():
    assert serve_parity.verdict(REFERENCE, REFERENCE) == ("equal", None)


def test_a_swap_at_a_near_tie_is_a_flip():
    ours = answer(["Paris", " was", " nice"], [{"Paris": -0.1}, {" was": -0.49, " is": -0.51}, {}])
    assert serve_parity.verdict(ours, REFERENCE) == ("flip", 1)


def test_a_swap_past_the_tolerance_diverges():
    ours = answer(
        ["Paris", " is", " big"], [{"Paris": -0.1}, {" is": -0.5}, {" big": -0.1, " nice": -0.3}]
    )
    assert serve_parity.verdict(ours, REFERENCE) == ("diverged", 2)


def test_a_token_outside_the_other_top_5_diverges_even_when_close():
    ours = answer(["Paris", " was", " nice"], [{"Paris": -0.1}, {" was": -0.49}, {}])
    assert serve_parity.verdict(ours, REFERENCE) == ("diverged", 1)


def test_stopping_early_diverges_at_the_shorter_length():
    ours = answer(["Paris", " is"], REFERENCE["top"][:2])
    assert serve_parity.verdict(ours, REFERENCE) == ("diverged", 2)
