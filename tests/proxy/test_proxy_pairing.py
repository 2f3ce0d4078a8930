"""`zllm proxy`'s check at start (zllm/proxy/pairing.py): it serves only servers that can
pass KV blocks to each other (prefill servers kv_producers, decode servers kv_consumers, all
on the same weights, which each server's GET /v1/models names), and what stands behind it
when a pair is wrong anyway: the decode server refuses the blocks, logs an error and counts
them (zllm:kv_transfer_rejected_blocks_total{reason="layout"})."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from disagg_pairs import PROMPTS, Proxy, kv_config, remote_hits
from servers import free_port, metric, start_server, stop_server, wait_until

from zllm.proxy.pairing import PairingError, ServerModel, check_pairing

PREFILL = ServerModel("http://p:1", "prefill", "m", "kv_producer", "0123456789abcdef")
DECODE = ServerModel("http://d:2", "decode", "m", "kv_consumer", "0123456789abcdef")


def test_a_pairing_wants_each_sides_role_and_the_same_weights():
    check_pairing([PREFILL, DECODE])
    other = ServerModel("http://d:2", "decode", "m", "kv_consumer", "fedcba9876543210")
    with pytest.raises(PairingError) as refused:
        check_pairing([PREFILL, other])
    assert str(refused.value) == (
        "the servers run different weights, so no KV block can pass between them (a decode "
        "server refuses blocks of other weights, whatever the files' names and sizes): "
        "prefill http://p:1 (m, weights 0123456789abcdef), "
        "decode http://d:2 (m, weights fedcba9876543210)"
    )
    swapped = [
        ServerModel("http://p:1", "prefill", "m", "kv_consumer", "0123456789abcdef"),
        ServerModel("http://d:2", "decode", "m", None, None),
    ]
    with pytest.raises(PairingError) as refused:
        check_pairing(swapped)
    assert str(refused.value) == (
        "the prefill server at http://p:1 is a kv_consumer, not a kv_producer; the decode "
        "server at http://d:2 is in no KV transfer (no --kv-transfer-config), not a kv_consumer"
    )


def run_proxy(prefill: str, decode: str, *extra: str) -> subprocess.CompletedProcess:
    """`zllm proxy` that is expected to exit at start (within 60 s)."""
    cmd = [sys.executable, "-m", "zllm.cli", "proxy", "--prefill", prefill, "--decode", decode]
    cmd += ["--port", str(free_port()), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.e2e
def test_two_models_of_one_name_and_size_are_refused_as_a_pair(tmp_path):
    """Three copies of one tiny model's files, two with the same weights and one with other
    weights of the same names and sizes. The decode server (with an API key) on the first:
    the proxy refuses the pair with the other weights' prefill server, naming both servers
    and both fingerprints, and serves the pair of equal weights (the decode server loading
    the prompt's blocks from the transfer). Blocks sent to it anyway by the other weights'
    server are refused, logged as an error and counted."""
    from conftest import write_tiny_model

    a, b, c = (
        write_tiny_model(tmp_path / where / "model", seed=seed)
        for where, seed in (("a", 0), ("b", 1), ("c", 0))
    )
    assert {p.name: p.stat().st_size for p in a.iterdir()} == {
        p.name: p.stat().st_size for p in b.iterdir()
    }
    port = free_port()
    name = ("--served-model-name", "tiny")  # (one name for all: the proxy asks both servers)
    decode = start_server(
        str(a), tmp_path / "decode.log", *name, "--kv-transfer-config",
        kv_config("kv_consumer", port, wait_timeout_s=30), api_key="secret",
    )  # fmt: skip
    servers = [decode]
    try:
        for model in (b, c):
            producer = kv_config("kv_producer", port)
            log = tmp_path / f"prefill-{model.parent.name}.log"
            servers.append(start_server(str(model), log, *name, "--kv-transfer-config", producer))
        _, other, same = servers
        cards = [s.get("/v1/models").json()["data"][0]["kv_transfer"] for s in servers]
        assert [card["role"] for card in cards] == ["kv_consumer", "kv_producer", "kv_producer"]
        mine, others, sames = (card["weights_fingerprint"] for card in cards)
        assert mine == sames != others

        # The proxy needs the key to ask the decode server, then refuses the pair.
        no_key = run_proxy(other.url, decode.url)
        assert no_key.returncode == 2
        assert f"decode server at {decode.url} wants an API key" in no_key.stderr
        refused = run_proxy(other.url, decode.url, "--api-key", "secret")
        assert refused.returncode == 2, refused.stderr
        assert f"prefill {other.url} (" in refused.stderr and f"weights {others})" in refused.stderr
        assert f"decode {decode.url} (" in refused.stderr and f"weights {mine})" in refused.stderr

        # What the check keeps from happening: the other weights' blocks are refused.
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        marked = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        assert other.post("/v1/completions", marked).status_code == 200

        def rejected() -> float:
            text = decode.get("/metrics").text
            return metric(text, "zllm:kv_transfer_rejected_blocks_total", 'reason="layout"')

        assert wait_until(lambda: rejected() > 0, 30), decode.log_tail()
        text = decode.get("/metrics").text
        assert metric(text, "zllm:kv_transfer_rejected_blocks_total", 'reason="invalid"') == 0
        assert remote_hits(decode) == 0
        refusal = "blocks refused: blocks of another model, weights or KV layout"
        assert [line for line in decode.log_text().splitlines() if refusal in line]

        # The same weights in another directory: the proxy starts and the pair serves.
        proxy = Proxy(same.url, decode.url, tmp_path / "proxy.log", "--api-key", "secret")
        try:
            reference = same.post("/v1/completions", body).json()["choices"][0]["text"]
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="secret", max_retries=0)
            answer = client.completions.create(model="tiny", **body)
            assert answer.choices[0].text == reference
            assert wait_until(lambda: remote_hits(decode) > 0, 30), decode.log_tail()
        finally:
            proxy.stop()
    finally:
        for server in servers:
            stop_server(server)
