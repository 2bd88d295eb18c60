"""A real redis-server (Debian's) for the cluster tests, set up as a job's
Redis should be: the `default` user off, one ACL user per node's agent that
may append only to its own stream and read the command stream, one for the
controller; optionally TLS with a CA and server certificate made here with
openssl (and client certificates accepted, not required)."""
from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

import redis

from harness import free_port, wait_for


def agent_acl(job: str, node: str) -> str:
    return (f"~gh:{job}:ev:{node} %R~gh:{job}:cmd +xadd +xread +xrevrange +ping +hello "
            "+auth")


def controller_acl(job: str) -> str:
    return (f"~gh:{job}:* +@stream +scan +set +get +incrby +eval +pexpire +del +ping +hello "
            "+auth")


def make_certs(d: Path, ip: str) -> dict[str, Path]:
    """A CA, a server certificate for `ip`, and a client certificate."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=greyhound-test-ca")
    (d / "san.ext").write_text(f"subjectAltName=IP:{ip}\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN=greyhound-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                               "client.key")}


class RedisBed:
    def __init__(self, d: Path, job: str, nodes: list[str], bind: str = "127.0.0.1",
                 tls: bool = False):
        self.d, self.job, self.bind, self.tls = d, job, bind, tls
        self.port = free_port()
        self.passwords = {f"agent-{n}": secrets.token_hex(8) for n in nodes}
        self.passwords["controller"] = secrets.token_hex(8)
        self.certs = make_certs(d, bind) if tls else {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.bind}:{self.port}"

    def config(self) -> str:
        lines = [f"bind {self.bind}", f"dir {self.d}", 'save ""', "appendonly no",
                 "user default off"]
        if self.tls:
            c = self.certs
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {c['server.pem']}",
                      f"tls-key-file {c['server.key']}", f"tls-ca-cert-file {c['ca.pem']}",
                      "tls-auth-clients optional"]
        else:
            lines.append(f"port {self.port}")
        for user, pw in self.passwords.items():
            acl = (controller_acl(self.job) if user == "controller"
                   else agent_acl(self.job, user[len("agent-"):]))
            lines.append(f"user {user} on >{pw} {acl}")
        return "\n".join(lines) + "\n"

    def secret_file(self, user: str) -> Path:
        p = self.d / f"{user}.secret"
        p.write_text(self.passwords[user] + "\n")
        p.chmod(0o600)
        return p

    def client(self, user: str, password: str | None = None) -> redis.Redis:
        kw = {}
        if self.tls:
            kw = dict(ssl=True, ssl_ca_certs=str(self.certs["ca.pem"]))
        return redis.Redis(host=self.bind, port=self.port, username=user,
                           password=password or self.passwords[user], **kw)

    def start(self) -> "RedisBed":
        exe = shutil.which("redis-server")
        assert exe, "redis-server is missing: run sudo scripts/setup"
        (self.d / "redis.conf").write_text(self.config())
        self.proc = subprocess.Popen([exe, str(self.d / "redis.conf")],
                                     stdout=open(self.d / "out", "w"), stderr=subprocess.STDOUT)
        wait_for(self._up, 15, "redis-server")
        return self

    def _up(self) -> bool:
        try:
            return self.client("controller").ping()
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> "RedisBed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
