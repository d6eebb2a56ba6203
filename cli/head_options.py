"""The options of the commands that talk to the head as clients (``ranksight action``, ``ranksight ops``): where the
head is, its token, and TLS, declared once so that every such command reads the same flags and variables."""

from __future__ import annotations

from typing import Annotated

import typer

HeadUrl = Annotated[str, typer.Option("--head", envvar="RANKSIGHT_HEAD", help="The head's base URL.")]
HeadToken = Annotated[str, typer.Option("--token", envvar="RANKSIGHT_TOKEN", help="Bearer token the head requires.")]
TlsCa = Annotated[str, typer.Option("--tls-ca", envvar="RANKSIGHT_TLS_CA", help="CA (PEM) to verify an https head.")]
TlsClientCert = Annotated[str, typer.Option("--tls-client-cert", envvar="RANKSIGHT_TLS_CLIENT_CERT",
                                            help="Mutual TLS: the certificate to present to the head.")]
TlsClientKey = Annotated[str, typer.Option("--tls-client-key", envvar="RANKSIGHT_TLS_CLIENT_KEY",
                                           help="The private key of --tls-client-cert.")]
DEFAULT_HEAD = "http://127.0.0.1:4318"
