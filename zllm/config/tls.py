"""HTTPS for `zllm serve`: the `--ssl-*` options, as `vllm serve` spells them, checked before
any process starts.

The frontend processes hand them to uvicorn, which terminates TLS. Only the HTTP API is
encrypted: the ZeroMQ sockets between zllm's own processes (ipc:// in a private directory,
or loopback TCP) and the KV transfers between servers stay plaintext and belong on a private
network (README, "Security").
"""

from __future__ import annotations

import ssl


def check_tls(
    keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int
) -> None:
    """Raise ValueError, naming the option, unless the options make a working server
    context: a certificate and key that load and match, CA certificates that load, and
    client certificates asked for only with CAs to check them against."""
    if cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs {cert_reqs}: expected 0 (none), 1 or 2 (required)")
    if certfile is None:
        if keyfile is not None or ca_certs is not None or cert_reqs != ssl.CERT_NONE:
            raise ValueError(
                "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                "(the server's certificate: serving is HTTPS only with one)"
            )
        return
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError(
            f"--ssl-cert-reqs {cert_reqs} asks for client certificates: give --ssl-ca-certs, "
            "the CAs to check them against"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load the server's "
            f"certificate and key ({exc})"
        ) from exc
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: cannot load ({exc})") from exc
