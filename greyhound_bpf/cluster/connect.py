"""Connecting to the job's Redis, with secrets kept off the command line.

`/proc/PID/cmdline` is readable by every user of the node, and the
controller can pause jobs: a password is never taken from argv. It comes
from a file (`--cluster-secret FILE`, whose first line is the password) or
the environment (`GREYHOUND_REDIS_PASSWORD`); a URL with a password in it
is refused. `rediss://` is TLS: the server is checked against
`--cluster-ca` (else the system's CAs), and `--cluster-cert/--cluster-key`
give a client certificate where the server asks for one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from .. import GreyhoundError

PASSWORD_ENV = "GREYHOUND_REDIS_PASSWORD"
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    user: str
    secret_file: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def where(self) -> str:
        u = urlsplit(self.url)
        return f"{u.hostname}:{u.port or 6379}"


def endpoint(url: str, user: str, secret_file=None, ca=None, cert=None, key=None) -> Endpoint:
    """Check what can be checked before connecting (raises GreyhoundError)."""
    try:
        u = urlsplit(url)
        u.port                                   # noqa: B018 (a bad port raises here)
    except ValueError as e:
        raise GreyhoundError(f"--cluster {url!r}: {e}") from None
    if u.scheme not in ("redis", "rediss") or not u.hostname:
        raise GreyhoundError(f"--cluster {url!r}: give redis://HOST:PORT or "
                             "rediss://HOST:PORT (TLS)")
    if u.password is not None:
        raise GreyhoundError("--cluster: no password in the URL (every user of this machine "
                             f"can read a command line): put it in ${PASSWORD_ENV} or a file "
                             "given with --cluster-secret")
    if (cert is None) != (key is None):
        raise GreyhoundError("--cluster-cert and --cluster-key go together")
    if u.scheme == "redis" and (ca or cert):
        raise GreyhoundError("--cluster-ca/--cluster-cert are for TLS: use rediss://")
    for what, path in (("--cluster-secret", secret_file), ("--cluster-ca", ca),
                       ("--cluster-cert", cert), ("--cluster-key", key)):
        if path is not None and not os.access(path, os.R_OK):
            raise GreyhoundError(f"{what} {path}: cannot be read")
    return Endpoint(url, u.username or user, secret_file, ca, cert, key)


def password(ep: Endpoint, env=os.environ) -> str | None:
    if ep.secret_file:
        with open(ep.secret_file) as f:
            return f.readline().rstrip("\r\n") or None
    return env.get(PASSWORD_ENV) or None


def client(ep: Endpoint, env=os.environ):
    """A redis.Redis for `ep` (not yet connected)."""
    import redis
    u = urlsplit(ep.url)
    kw = dict(host=u.hostname, port=u.port or 6379, username=ep.user, password=password(ep, env),
              socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    if u.scheme == "rediss":
        kw.update(ssl=True, ssl_ca_certs=ep.ca, ssl_certfile=ep.cert, ssl_keyfile=ep.key,
                  ssl_cert_reqs="required")
    return redis.Redis(**kw)


class Refused(GreyhoundError):
    """The server answered and said no (credentials, certificate, ACL):
    trying again will not help."""


def check(r, ep: Endpoint) -> None:
    """PING as `ep.user`. Refused for credentials or a certificate the
    server rejects (one line), GreyhoundError when it cannot be reached."""
    import ssl

    import redis
    try:
        r.ping()
    except redis.AuthenticationError as e:
        raise Refused(f"redis at {ep.where} refused user {ep.user!r}: {e} (the password comes "
                      f"from {ep.secret_file or '$' + PASSWORD_ENV})") from None
    except redis.exceptions.NoPermissionError as e:
        raise Refused(f"redis at {ep.where}: user {ep.user!r} may not PING ({e})") from None
    except (ssl.SSLError, redis.ConnectionError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e.__context__, ssl.SSLError) or "SSL" in why or "certificate" in why:
            raise Refused(f"redis at {ep.where}: TLS failed: {why}") from None
        raise GreyhoundError(f"redis at {ep.where} cannot be reached: {why}",
                             exit_code=1) from None
