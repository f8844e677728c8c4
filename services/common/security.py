"""Authentication and TLS for meshtrain's gRPC services and their clients.

A server (data, checkpoint, the trainer's control endpoint) is given a `ServerSecurity`:
bearer tokens with scopes, a TLS certificate, and a client CA for mutual TLS. `make_server`
serves TLS when a certificate is given and installs `AuthInterceptor` when tokens or a client CA
are, which checks every call against the scope its method needs:

    read   data batches and Describe; checkpoint List, Describe, ReadSlice; control Status
    write  checkpoint BeginSave (overwrite=false), WriteShards, Commit, AbortSave, ResumeSave
    admin  checkpoint Delete, ApplyRetention, BeginSave with overwrite=true;
           control Checkpoint, Stop

admin implies write implies read. A call without a token, or with one the server does not
accept, is refused with UNAUTHENTICATED; a token whose scope is too low with PERMISSION_DENIED;
both messages name the method and the scope it needs, never a token. The health check
(`grpc.health.v1.Health/Check`) stays open, for probes; its Watch stream and server reflection
need `read`, since every stream holds one of the server's stream slots.

A token file is UTF-8 text, one token per line, each optionally preceded by its scope:

    # blank lines and lines starting with # are skipped
    read  4f0c...        a line "SCOPE TOKEN" (read, write or admin)
    9b1e...              a token alone has scope admin

A server accepts every token of its file; a client sends the one token its file holds (a scope
word before it is skipped), so one file serves both ends. Without a token file, the token in
$MESHTRAIN_TOKEN is used (scope admin on a server). Tokens are compared in constant time.

Mutual TLS is the alternative: with a client CA the server completes a handshake only with a
client certificate signed by it, and such a client has every scope; with tokens as well, the
certificate admits the connection and the token decides the scope. A server refuses to bind an
address other than loopback unless it authenticates callers (tokens or a client CA) or is told
`insecure`.

A client is given a `ClientSecurity` (`services/common/client_security.py`): the token it
sends, the CA that verifies the server's certificate, and its own certificate and key for
mutual TLS. `AuthConfig` is the trainer's `[auth]` config section, for both ends.

This module imports grpc only where a server is built, so configs and command lines that use
it stay free of grpc.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.sanitize import Undecodable

log = logging.getLogger("meshtrain.security")

READ, WRITE, ADMIN = "read", "write", "admin"
SCOPE_RANK = {READ: 0, WRITE: 1, ADMIN: 2}  # a scope grants every scope ranked below it
TOKEN_ENV = "MESHTRAIN_TOKEN"  # the token itself, used where no token file is given
AUTH_METADATA = "authorization"  # gRPC metadata keys are lower case
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
READ_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # Watch and reflection streams

Scope = str | Callable[[Any], str]  # a method's scope, or a function of its request giving it


def read_token_file(path: str) -> dict[str, str]:
    """The tokens of a token file and their scopes.

    Raises:
        ConfigError: the file cannot be read, holds no token, or a line is malformed (named by
            its number, never its token).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "token file %s can be read by other users (mode %o): chmod 600 it", path, mode & 0o777
        )
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) == 1:
            words = [ADMIN, words[0]]
        if len(words) != 2 or words[0] not in SCOPE_RANK:
            raise ConfigError(
                f"token file {path} line {number}: expected 'TOKEN' or 'SCOPE TOKEN' with SCOPE "
                f"one of {', '.join(SCOPE_RANK)}; got {len(words)} words"
                + (", the first not a scope" if len(words) == 2 else "")
            )
        check_token(words[1], f"token file {path} line {number}")
        tokens[words[1]] = words[0]
    if not tokens:
        raise ConfigError(f"token file {path} holds no token (lines 'TOKEN' or 'SCOPE TOKEN')")
    return tokens


def check_token(token: str, where: str) -> None:
    """Refuse a token that cannot travel in a gRPC header or is too short to be a secret."""
    if not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"{where}: a token must be printable ASCII without spaces")
    if len(token) < 16:
        raise ConfigError(
            f"{where}: the token is {len(token)} characters; use at least 16 "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def server_tokens(token_file: str | None) -> dict[str, str]:
    """The tokens a server accepts: those of `token_file`, else $MESHTRAIN_TOKEN (scope admin), else
    none."""
    if token_file:
        return read_token_file(token_file)
    token = os.environ.get(TOKEN_ENV)
    if token:
        check_token(token, f"${TOKEN_ENV}")
        return {token: ADMIN}
    return {}


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to bind) is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror}") from None


@dataclass
class ServerSecurity:
    """How a server authenticates its callers and encrypts its connections.

    Attributes:
        tokens: accepted bearer tokens and their scopes (kept out of repr).
        tls_cert_file: PEM certificate (chain) the server presents; TLS is on when set.
        tls_key_file: PEM private key of that certificate.
        tls_client_ca_file: PEM CA whose client certificates are required (mutual TLS).
        insecure: allow binding an address other than loopback without authentication.
        settings: how the settings above are given, for the refusal of an open address (the
            serve commands' flags by default; the trainer names its config keys).
    """

    tokens: dict[str, str] = field(default_factory=dict, repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    insecure: bool = False
    settings: tuple[str, str] = field(
        default=(
            f"a token file (--token-file, or ${TOKEN_ENV}) or mutual TLS (--tls-cert, --tls-key, "
            "--tls-client-ca)",
            "--insecure",
        ),
        repr=False,
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(
                "--tls-client-ca (mutual TLS) needs the server's own --tls-cert and --tls-key"
            )
        for token, scope in self.tokens.items():
            if scope not in SCOPE_RANK:
                raise ConfigError(
                    f"unknown token scope {scope!r}; the scopes are {', '.join(SCOPE_RANK)}"
                )

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        insecure: bool = False,
        **kwargs,
    ) -> ServerSecurity:
        """Read the token file (or $MESHTRAIN_TOKEN) and check the TLS files can be read."""
        security = cls(
            server_tokens(token_file), tls_cert, tls_key, tls_client_ca, insecure, **kwargs
        )
        for path, what in (
            (tls_cert, "TLS certificate"),
            (tls_key, "TLS key"),
            (tls_client_ca, "client CA"),
        ):
            if path:
                _read(path, what)
        return security

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        """From the flags `add_server_arguments` defines (absent ones: unset)."""
        return cls.from_files(
            **{
                name: getattr(args, name, None)
                for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca")
            },
            insecure=bool(getattr(args, "insecure", False)),
        )

    @property
    def authenticates(self) -> bool:
        """Whether callers must prove who they are (a token, or a client certificate)."""
        return bool(self.tokens) or bool(self.tls_client_ca_file)

    def check_bind(self, host: str, port: int) -> None:
        """Refuse to serve `host` beyond loopback without authentication, unless insecure."""
        if is_loopback(host) or self.authenticates or self.insecure:
            return
        how, insecure = self.settings
        raise ConfigError(
            f"refusing to serve {host}:{port} without authentication: an address other than "
            f"loopback is reachable from other machines. Give {how}, bind 127.0.0.1, or set "
            f"{insecure} to serve it open"
        )

    def server_credentials(self):
        """grpc server credentials for TLS (None without a certificate)."""
        if not self.tls_cert_file:
            return None
        import grpc

        client_ca = _read(self.tls_client_ca_file, "client CA") if self.tls_client_ca_file else None
        assert self.tls_key_file is not None  # __post_init__: a certificate comes with its key
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key_file, "TLS key"), _read(self.tls_cert_file, "TLS certificate"))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def interceptor(self, scopes: dict[str, Scope]) -> AuthInterceptor | None:
        """The interceptor enforcing `scopes` (full method name -> scope), or None when callers
        are not authenticated."""
        if not self.authenticates:
            return None
        return AuthInterceptor(self.tokens, scopes, mutual_tls=bool(self.tls_client_ca_file))


def method_scopes(service_name: str, scopes: dict[str, Scope]) -> dict[str, Scope]:
    """`scopes` keyed by short method name, keyed by the full name gRPC gives the interceptor."""
    return {f"/{service_name}/{name}": scope for name, scope in scopes.items()}


class AuthInterceptor:
    """A grpc.ServerInterceptor (gRPC calls its `intercept_service`; the base class is not named
    so that this module imports without grpc) checking each call's token or client certificate
    against the scope its method needs.

    A method missing from the table needs admin, so one added to a service without a scope is
    closed rather than open. A scope given as a function of the request (BeginSave's depends on
    its `overwrite`) is checked once the request is read, before the servicer sees it.

    Args:
        tokens: accepted tokens and their scopes.
        scopes: full method name ("/package.Service/Method") -> scope or function of the request.
        mutual_tls: the server requires client certificates; with no tokens they grant admin.
    """

    def __init__(self, tokens: dict[str, str], scopes: dict[str, Scope], mutual_tls: bool = False):
        self._tokens = [(t.encode(), s) for t, s in tokens.items()]
        self.scopes = dict(scopes)
        self.mutual_tls = mutual_tls

    def __repr__(self) -> str:
        return f"AuthInterceptor({len(self._tokens)} tokens, mutual_tls={self.mutual_tls})"

    def _granted(self, context, method: str, need: str) -> str:
        """The scope the caller holds, or abort with UNAUTHENTICATED."""
        import grpc

        if not self._tokens:  # mutual TLS alone: the handshake verified a client certificate
            if context.auth_context().get("x509_pem_cert"):
                return ADMIN
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a client certificate signed by this server's client CA",
            )
        sent = None
        for key, value in context.invocation_metadata() or ():
            if key == AUTH_METADATA:
                sent = value
        if sent is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs a bearer token with scope {need} (metadata '{AUTH_METADATA}: "
                "Bearer TOKEN'); the call carried none",
            )
        scheme, _, token = (sent if isinstance(sent, str) else "").partition(" ")
        granted = None
        candidate = token.strip().encode()
        for (
            accepted,
            scope,
        ) in self._tokens:  # every one compared: the time does not tell which matched
            if hmac.compare_digest(candidate, accepted) and scheme.lower() == "bearer":
                granted = scope
        if granted is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: the bearer token sent is not one this server accepts",
            )
        assert granted is not None  # context.abort raised
        return granted

    def _check(self, context, method: str, need: str) -> None:
        import grpc

        granted = self._granted(context, method, need)
        if SCOPE_RANK[granted] < SCOPE_RANK[need]:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs scope {need}; the token sent has scope {granted}",
            )

    def _scope(self, method: str) -> Scope:
        if method in self.scopes:
            return self.scopes[method]
        return READ if method.startswith(READ_PREFIXES) else ADMIN

    def intercept_service(self, continuation, handler_call_details):
        from meshtrain.services.common.grpc_utils import rewrap_handler

        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        scope = self._scope(method)
        if callable(scope) and handler.request_streaming:
            raise TypeError(f"{method} streams its requests: its scope cannot depend on one")

        def need(request) -> str:
            if not callable(scope):
                return scope
            # a request that did not parse has no fields to read: the highest scope it could
            # need; the sanitizer refuses it as INVALID_ARGUMENT once the caller may call at all
            return ADMIN if request is None or isinstance(request, Undecodable) else scope(request)

        def around(inner, streams_responses: bool):
            if handler.request_streaming:

                def checked_requests(request_iterator, context):
                    self._check(context, method, need(None))
                    return inner(request_iterator, context)

                if streams_responses:

                    def checked_requests_stream(request_iterator, context):
                        self._check(context, method, need(None))
                        yield from inner(request_iterator, context)

                    return checked_requests_stream
                return checked_requests
            if streams_responses:

                def checked_stream(request, context):
                    self._check(context, method, need(request))
                    yield from inner(request, context)

                return checked_stream

            def checked(request, context):
                self._check(context, method, need(request))
                return inner(request, context)

            return checked

        return rewrap_handler(handler, around)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The authentication and TLS flags of `meshtrain data serve` and `meshtrain ckpt serve`."""
    g = p.add_argument_group("authentication and TLS")
    g.add_argument(
        "--token-file",
        default=None,
        help="bearer tokens callers must send, one per line as 'SCOPE TOKEN' (read, write, "
        f"admin) or 'TOKEN' (admin); default: ${TOKEN_ENV} (scope admin) if set, else no tokens",
    )
    g.add_argument(
        "--tls-cert", default=None, help="PEM certificate the server presents (turns TLS on)"
    )
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA: clients must present a certificate it signed (mutual TLS; every scope "
        "unless --token-file is given too)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="serve an address other than loopback without authentication",
    )


@dataclass
class AuthConfig:
    """Authentication and TLS of the trainer's connections: to the data and checkpoint services
    (as their client) and of its control endpoint (as its server). Paths only: the token itself
    never enters the config or RUN_DIR/config.toml."""

    token_file: str | None = None
    """File holding the bearer token sent to the data and checkpoint services (one line: 'TOKEN'
    or 'SCOPE TOKEN'), and the tokens the control endpoint accepts (Status needs read, Checkpoint
    and Stop admin); unset: $MESHTRAIN_TOKEN if set, else no token."""
    tls_ca_file: str | None = None
    """PEM CA that verifies the data and checkpoint services' certificates; set, the trainer
    connects to them over TLS."""
    tls_cert_file: str | None = None
    """PEM certificate of the trainer: its client certificate for services that require mutual
    TLS, and the certificate the control endpoint serves TLS with."""
    tls_key_file: str | None = None
    """PEM private key of auth.tls_cert_file."""
    tls_client_ca_file: str | None = None
    """PEM CA whose client certificates the control endpoint requires (mutual TLS; needs
    auth.tls_cert_file)."""
    tls_server_name: str | None = None
    """Name the services' certificates are verified against when it is not the host of their
    address (e.g. addresses given as IPs)."""
    insecure: bool = False
    """Let the control endpoint bind an address other than loopback without authentication."""

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError(
                "auth.tls_cert_file and auth.tls_key_file go together: set both or neither"
            )
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(
                "auth.tls_client_ca_file (mutual TLS on the control endpoint) needs "
                "auth.tls_cert_file and auth.tls_key_file"
            )
