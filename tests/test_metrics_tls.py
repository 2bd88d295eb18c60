"""Metrics over TLS, with prometheus-client's own options: a real server, a
real certificate made with openssl, real scrapes. Plain HTTP on an address
other than loopback is refused unless asked for."""
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import run_cli
from greyhound_bpf.output.metrics import Metrics


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA, so it can also
    stand for a scraper's client certificate)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=greyhound-test", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return str(d / "cert.pem"), str(d / "key.pem")


def _scrape(url: str, ctx: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
        return r.read().decode()


def test_tls_scrape_and_no_plain_http(cert):
    m = Metrics(0, "127.0.0.1", {"certfile": cert[0], "keyfile": cert[1]})
    try:
        assert m.url == f"https://127.0.0.1:{m.port}/metrics"
        body = _scrape(m.url, ssl.create_default_context(cafile=cert[0]))
        assert "greyhound_build_info" in body
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _scrape(f"http://127.0.0.1:{m.port}/metrics")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _scrape(m.url, ssl.create_default_context())      # an untrusted server
    finally:
        m.server.shutdown()


def test_mutual_tls_needs_a_client_certificate(cert):
    m = Metrics(0, "127.0.0.1", {"certfile": cert[0], "keyfile": cert[1],
                                 "client_cafile": cert[0]})
    try:
        anonymous = ssl.create_default_context(cafile=cert[0])
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            _scrape(m.url, anonymous)
        known = ssl.create_default_context(cafile=cert[0])
        known.load_cert_chain(*cert)
        assert "greyhound_build_info" in _scrape(m.url, known)
    finally:
        m.server.shutdown()


@pytest.mark.parametrize("args,why", [
    (["--metrics", "0.0.0.0:9400"], "reachable from the network"),
    (["--metrics", "[::]:9400"], "reachable from the network"),
    (["--metrics", "9400", "--metrics-cert", "/etc/hostname"], "go together"),
    (["--metrics", "9400", "--metrics-client-ca", "/etc/hostname"], "needs TLS"),
    (["--metrics", "9400", "--metrics-cert", "/nonexistent.pem", "--metrics-key",
      "/nonexistent.pem"], "no such file"),
])
def test_bad_metrics_tls_is_one_line(args, why):
    r = run_cli("attach", "1", *args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert why in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_bad_certificate_is_one_line(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    from greyhound_bpf import GreyhoundError
    with pytest.raises(GreyhoundError, match="cannot serve TLS with them"):
        Metrics(0, "127.0.0.1", {"certfile": str(junk), "keyfile": str(junk)})
