"""The client side of meshtrain's gRPC authentication and TLS: what a client sends and verifies.

A client is given a `ClientSecurity`: the token it sends (metadata `authorization: Bearer
TOKEN` on every call), the CA that verifies the server's certificate (turns TLS on), and its own
certificate and key for mutual TLS. Its token comes from a token file holding one token (a
scope word before it is skipped, so one file serves both ends), else from $MESHTRAIN_TOKEN.
The token file's format, the scopes and the server's checks are
`meshtrain.services.common.security`'s.

This module imports grpc only where a channel is built, so configs and command lines that use
it stay free of grpc.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.security import (
    AUTH_METADATA,
    TOKEN_ENV,
    AuthConfig,
    _read,
    check_token,
    read_token_file,
)


def client_token(token_file: str | None) -> str | None:
    """The token a client sends: the one token of `token_file`, else $MESHTRAIN_TOKEN, else None.

    Raises:
        ConfigError: the file is unreadable or malformed, or holds more than one token.
    """
    if token_file:
        tokens = read_token_file(token_file)
        if len(tokens) > 1:
            raise ConfigError(
                f"token file {token_file} holds {len(tokens)} tokens; a client's file holds the "
                "one it sends"
            )
        return next(iter(tokens))
    token = os.environ.get(TOKEN_ENV)
    if token:
        check_token(token, f"${TOKEN_ENV}")
    return token or None


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a command-line client (`meshtrain status`, the health probe)."""
    g = p.add_argument_group("authentication and TLS")
    g.add_argument(
        "--token-file",
        default=None,
        help=f"file holding the bearer token to send (default: ${TOKEN_ENV})",
    )
    g.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA that verifies the server's certificate (turns TLS on)",
    )
    g.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-server-name",
        default=None,
        help="name to verify the server's certificate against, when it is not the address's host",
    )


@dataclass
class ClientSecurity:
    """What a client sends and verifies.

    Attributes:
        token: bearer token sent with every call (kept out of repr); None: none.
        ca_file: PEM CA that verifies the server's certificate; TLS is on when it or `cert_file` is
            set (with `cert_file` alone, the system's CAs verify the server).
        cert_file: PEM client certificate (mutual TLS).
        key_file: its PEM private key.
        server_name: the name the server's certificate must carry, when not the address's host.
    """

    token: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(
                "a client certificate needs its key, and a key its certificate "
                "(auth.tls_cert_file and auth.tls_key_file, or --tls-cert and --tls-key)"
            )

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
    ) -> ClientSecurity:
        """Read the token (`token_file`, else $MESHTRAIN_TOKEN) and check the TLS files can be
        read."""
        security = cls(client_token(token_file), ca_file, cert_file, key_file, server_name)
        for path, what in (
            (ca_file, "CA"),
            (cert_file, "client certificate"),
            (key_file, "client key"),
        ):
            if path:
                _read(path, what)
        return security

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientSecurity:
        """From the flags `add_client_arguments` defines."""
        return cls.from_files(
            args.token_file, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name
        )

    @classmethod
    def from_config(cls, auth: AuthConfig | None) -> ClientSecurity:
        """From the trainer's `[auth]` section (None: $MESHTRAIN_TOKEN only)."""
        if auth is None:
            return cls.from_files()
        return cls.from_files(
            auth.token_file,
            auth.tls_ca_file,
            auth.tls_cert_file,
            auth.tls_key_file,
            auth.tls_server_name,
        )

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def channel(self, address: str, options: list | None = None):
        """A channel to `address`: TLS as configured, the token on every call."""
        import grpc

        options = list(options or [])
        if self.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca_file, "CA") if self.ca_file else None,
                private_key=_read(self.key_file, "client key") if self.key_file else None,
                certificate_chain=_read(self.cert_file, "client certificate")
                if self.cert_file
                else None,
            )
            if self.server_name:
                options.append(("grpc.ssl_target_name_override", self.server_name))
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token:
            channel = grpc.intercept_channel(channel, _bearer_interceptor(self.token))
        return channel


def _bearer_interceptor(token: str):
    """A client interceptor adding `authorization: Bearer TOKEN` to every call. Metadata rather
    than call credentials: gRPC sends call credentials over TLS only, and a token also guards
    plaintext loopback services (`meshtrain up`)."""
    import grpc

    header = (AUTH_METADATA, f"Bearer {token}")

    class BearerToken(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        def _details(self, details):
            return details._replace(metadata=[*(details.metadata or ()), header])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_stream_unary(self, continuation, details, request_iterator):
            return continuation(self._details(details), request_iterator)

        def intercept_stream_stream(self, continuation, details, request_iterator):
            return continuation(self._details(details), request_iterator)

        def __repr__(self) -> str:
            return "BearerToken(...)"

    return BearerToken()
