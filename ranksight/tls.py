"""TLS for ranksight's HTTP servers (the head; the agent's /metrics + /control endpoint) and their clients, with the
stdlib ``ssl`` module only.

A server is given a certificate and key (``--tls-cert``/``--tls-key``) and, for mutual TLS, the CA its clients'
certificates must chain to (``--tls-client-ca``). A client is given the CA to verify the server against
(``--tls-ca``; the system's CAs when absent) and, for mutual TLS, its own certificate and key
(``--tls-client-cert``/``--tls-client-key``). Both sides refuse anything older than TLS 1.2.

Plain http stays the default, for loopback: ``is_loopback`` is what the head uses to refuse a non-loopback bind
without TLS, so that a bearer token never crosses the network in cleartext by accident.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass

MIN_VERSION = ssl.TLSVersion.TLSv1_2


class TlsConfigError(ValueError):
    """A TLS option that cannot work: a file missing or unreadable, a key that does not match its certificate, a
    half-given pair. The message names the option and the file."""


def _readable(option: str, path: str) -> str:
    if not os.path.isfile(path):
        raise TlsConfigError(f"{option} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise TlsConfigError(f"{option} {path}: not readable")
    return path


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS options; ``context()`` builds its ``SSLContext``."""

    cert: str
    key: str
    client_ca: str | None = None  # set: clients must present a certificate chained to it (mutual TLS)

    @classmethod
    def from_options(cls, cert: str | os.PathLike | None, key: str | os.PathLike | None,
                     client_ca: str | os.PathLike | None = None) -> "ServerTls | None":
        """None when no TLS option is given (plain http); TlsConfigError for a half-given pair or a client CA
        without a certificate to serve."""
        cert, key, client_ca = (os.fspath(v) if v else None for v in (cert, key, client_ca))
        if not cert and not key:
            if client_ca:
                raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
            return None
        if not cert or not key:
            raise TlsConfigError("--tls-cert and --tls-key go together: give both, or neither for plain http")
        return cls(_readable("--tls-cert", cert), _readable("--tls-key", key),
                   _readable("--tls-client-ca", client_ca) if client_ca else None)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = MIN_VERSION
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"--tls-cert {self.cert} / --tls-key {self.key}: cannot load them "
                                 f"(a PEM certificate and its matching private key): {e}") from None
        if self.client_ca:
            try:
                ctx.load_verify_locations(cafile=self.client_ca)
            except (ssl.SSLError, OSError) as e:
                raise TlsConfigError(f"--tls-client-ca {self.client_ca}: not a PEM CA bundle: {e}") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS options, for https URLs: ``ca`` (None: the system's CAs) and an optional certificate + key
    for mutual TLS. ``context()`` is for urllib / http.client, ``requests_verify`` / ``requests_cert`` for
    requests (the OTLP exporters)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_options(cls, ca: str | os.PathLike | None = None, cert: str | os.PathLike | None = None,
                     key: str | os.PathLike | None = None) -> "ClientTls":
        ca, cert, key = (os.fspath(v) if v else None for v in (ca, cert, key))
        if bool(cert) != bool(key):
            raise TlsConfigError("--tls-client-cert and --tls-client-key go together: give both, or neither")
        return cls(_readable("--tls-ca", ca) if ca else None,
                   _readable("--tls-client-cert", cert) if cert else None,
                   _readable("--tls-client-key", key) if key else None)

    def context(self) -> ssl.SSLContext:
        """Verifies the server's certificate and host name (against ``ca``, else the system's CAs)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.minimum_version = MIN_VERSION
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, OSError) as e:
                raise TlsConfigError(f"--tls-client-cert {self.cert} / --tls-client-key {self.key}: cannot load "
                                     f"them: {e}") from None
        return ctx

    @property
    def requests_verify(self) -> str | bool:
        return self.ca or True

    @property
    def requests_cert(self) -> tuple[str, str] | None:
        return (self.cert, self.key) if self.cert and self.key else None


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) only reaches this machine. A name counts when every address it
    resolves to is loopback; one that does not resolve does not count (better refused than exposed)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


ENV_CA, ENV_CLIENT_CERT, ENV_CLIENT_KEY = "RANKSIGHT_TLS_CA", "RANKSIGHT_TLS_CLIENT_CERT", "RANKSIGHT_TLS_CLIENT_KEY"


def client_tls_from_env(environ=os.environ) -> ClientTls:
    """The client options from the environment (what ``--tls-ca``, ``--tls-client-cert`` and ``--tls-client-key``
    read when not given): for the commands that call the head without options of their own (``ranksight launch
    --head-url https://...``'s findings feed) and the agents they start."""
    return ClientTls.from_options(environ.get(ENV_CA), environ.get(ENV_CLIENT_CERT), environ.get(ENV_CLIENT_KEY))
