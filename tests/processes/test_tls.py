"""HTTPS for `zllm serve` (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs),
against a CA, server and client certificates made here (trustme), through the openai client."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import httpx
import openai
import pytest
import trustme
from servers import start_server, stop_server

from zllm.config.tls import check_tls


@dataclass
class Certs:
    ca: trustme.CA
    ca_pem: str
    server_pem: str  # the server's certificate chain
    server_key: str
    client: trustme.LeafCert  # a certificate the CA issued to a client

    def client_context(self, with_certificate: bool = True) -> ssl.SSLContext:
        """A client trusting the CA, presenting the client certificate or none."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        if with_certificate:
            self.client.configure_cert(context)
        return context


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    out = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    paths = {name: str(out / name) for name in ("ca.pem", "server.pem", "server.key")}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    server.private_key_pem.write_to_path(paths["server.key"])
    for i, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(paths["server.pem"], append=i > 0)
    client = ca.issue_cert("client@zllm.test")
    return Certs(ca, paths["ca.pem"], paths["server.pem"], paths["server.key"], client)


def test_incomplete_or_broken_tls_options_are_refused(certs, tmp_path):
    check_tls(certs.server_key, certs.server_pem, certs.ca_pem, ssl.CERT_REQUIRED)  # loads
    check_tls(None, None, None, ssl.CERT_NONE)  # plain HTTP
    other_key = tmp_path / "other.key"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    cases = [
        ((certs.server_key, None, None, 0), "need --ssl-certfile"),
        ((None, None, certs.ca_pem, 0), "need --ssl-certfile"),
        ((certs.server_key, certs.server_pem, None, ssl.CERT_REQUIRED), "give --ssl-ca-certs"),
        ((str(other_key), certs.server_pem, None, 0), "cannot load the server's certificate"),
        ((certs.server_key, str(tmp_path / "missing.pem"), None, 0), "cannot load"),
        ((certs.server_key, certs.server_pem, str(not_pem), 1), "--ssl-ca-certs"),
        ((certs.server_key, certs.server_pem, certs.ca_pem, 3), "expected 0"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check_tls(*args)


@pytest.mark.e2e
def test_https_with_client_certificates_required(tiny_llama_dir, certs, tmp_path):
    """The openai client over HTTPS with a client certificate is served; one without a
    certificate, one that does not trust the server's CA, and plain HTTP are all refused."""
    tls = ["--ssl-keyfile", certs.server_key, "--ssl-certfile", certs.server_pem,
           "--ssl-ca-certs", certs.ca_pem, "--ssl-cert-reqs", "2"]  # fmt: skip
    server = start_server(tiny_llama_dir, tmp_path / "serve.log", *tls, tls=certs.client_context())
    try:
        assert server.url.startswith("https://")

        def client(verify: ssl.SSLContext) -> openai.OpenAI:
            http = openai.DefaultHttpxClient(verify=verify)
            return openai.OpenAI(
                base_url=server.url + "/v1", api_key="unused", http_client=http, max_retries=0
            )

        model = client(certs.client_context()).models.list().data[0].id
        done = client(certs.client_context()).completions.create(
            model=model,
            prompt="Hello",
            max_tokens=5,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"

        with pytest.raises(openai.APIConnectionError):  # no client certificate
            client(certs.client_context(with_certificate=False)).models.list()
        stranger = ssl.create_default_context()
        trustme.CA().configure_trust(stranger)  # some other CA: the server is not trusted
        with pytest.raises(openai.APIConnectionError):
            client(stranger).models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        assert server.healthy()  # the refused connections cost the server nothing
        assert f"on https://127.0.0.1:{server.port}" in server.log_text()
    finally:
        # The clients above leave idle keep-alive connections that never send TLS's
        # close_notify: SIGTERM still stops the server at once and cleanly (it waited out
        # asyncio's 30-second SSL shutdown timeout, and was killed, before).
        assert stop_server(server, timeout=10) == 0
