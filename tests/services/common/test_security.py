"""Bearer tokens, scopes and TLS on real data and checkpoint servers on loopback ports.

Certificates are made at test time with the `openssl` command line (a throwaway CA, a server
certificate for 127.0.0.1/localhost, client certificates from that CA and from another one).
"""

import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as ckpt_pb
from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as ckpt_grpc
from meshtrain.protos.dataloader.v1 import dataloader_pb2 as data_pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as data_grpc
from meshtrain.services.checkpoint.rpc import server as ckpt_server
from meshtrain.services.checkpoint.rpc.client import CheckpointClient
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import CheckpointError, ConfigError, DataError
from meshtrain.services.common.grpc_server import make_server
from meshtrain.services.common.security import (
    ServerSecurity,
    check_token,
    is_loopback,
    read_token_file,
)
from meshtrain.services.dataloader.rpc import server as data_server
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.servicer import spec_to_proto
from meshtrain.services.dataloader.spec import DatasetSpec
from meshtrain.services.launcher.health import grpc_serving
from tests.services.dataloader.conftest import served_limits, write_dataset

TOKENS = {
    "read": "r" * 8 + "-read-token-0001",
    "write": "w" * 8 + "-write-token-002",
    "admin": "a" * 8 + "-admin-token-003",
}
WRONG = "x" * 8 + "-wrong-token-004"


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    """The server's file (every scope) and one client file per scope, mode 0600."""
    d = tmp_path_factory.mktemp("tokens")
    server = d / "server.tokens"
    server.write_text(
        "# scopes\n" + "".join(f"{scope} {token}\n" for scope, token in TOKENS.items())
    )
    files = {"server": str(server)}
    for scope, token in [*TOKENS.items(), ("wrong", WRONG)]:
        (d / scope).write_text(f"{token}\n")
        files[scope] = str(d / scope)
    for path in d.iterdir():
        path.chmod(0o600)
    return files


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d, name, ca, subject, usage):
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={subject}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-extfile",
        ext.name,
        cwd=d,
    )
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate and a client certificate it signed, and a client certificate
    of another CA: paths by name."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "1",
            "-subj",
            f"/CN={ca}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
            cwd=d,
        )
    server = _issue(d, "server", "ca", "localhost", "serverAuth")
    client = _issue(d, "client", "ca", "trainer", "clientAuth")
    stranger = _issue(d, "stranger", "other-ca", "stranger", "clientAuth")
    return {"ca": str(d / "ca.pem"), "server": server, "client": client, "stranger": stranger}


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def _bearer(scope):
    return (("authorization", f"Bearer {TOKENS[scope] if scope in TOKENS else WRONG}"),)


def test_token_files_give_each_token_its_scope_and_errors_never_show_a_token(tmp_path, token_files):
    assert read_token_file(token_files["server"]) == {t: s for s, t in TOKENS.items()}
    assert read_token_file(token_files["read"]) == {TOKENS["read"]: "admin"}  # a token alone: admin
    bad = tmp_path / "bad"
    bad.write_text(f"root {TOKENS['admin']}\n")
    with pytest.raises(ConfigError, match=f"{bad} line 1: .*SCOPE one of read, write, admin") as e:
        read_token_file(str(bad))
    assert TOKENS["admin"] not in str(e.value)
    with pytest.raises(ConfigError, match="at least 16"):
        check_token("short", "test")
    bad.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no token"):
        read_token_file(str(bad))
    with pytest.raises(ConfigError, match="holds 3 tokens"):
        ClientSecurity.from_files(token_files["server"])
    assert TOKENS["admin"] not in repr(ClientSecurity.from_files(token_files["admin"]))
    assert TOKENS["admin"] not in repr(ServerSecurity.from_files(token_files["server"]))


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.1.2.3", "node17"]))


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth-data")
    return DatasetSpec(
        (write_dataset(d / "a", 1),),
        (1.0,),
        seq_length=32,
        num_samples=8 * 16,
        seed=7,
        split="98,2,0",
    )


@pytest.fixture(scope="module")
def data_service(token_files):
    server, port, _ = data_server.start_server(
        0, security=ServerSecurity.from_files(token_files["server"]), limits=served_limits()
    )
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _describe(address, spec, metadata=None):
    with grpc.insecure_channel(address) as channel:
        request = data_pb.StreamRequest(
            spec=spec_to_proto(spec), dp_rank=0, dp_size=1, micro_batch_size=2, global_batch_size=16
        )
        return data_grpc.DataServiceStub(channel).Describe(request, timeout=30, metadata=metadata)


def test_data_service_needs_a_token_on_every_call_but_its_health_check(
    data_service, spec, token_files
):
    code, details = _code(lambda: _describe(data_service, spec))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert (
        "/meshtrain.dataloader.v1.DataService/Describe needs a bearer token with scope read"
        in details
    )
    code, details = _code(lambda: _describe(data_service, spec, _bearer("wrong")))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not one this server accepts" in details
    assert WRONG not in details
    assert _describe(data_service, spec, _bearer("read")).num_steps > 0
    assert grpc_serving(data_service)  # the health check stays open for probes
    with grpc.insecure_channel(data_service) as channel:  # its Watch stream does not
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert _code(lambda: next(watch))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_the_data_client_sends_its_token_and_fails_at_once_without_one(
    data_service, spec, token_files
):
    reader = ClientSecurity.from_files(token_files["read"])
    with ServiceBatchSource([data_service], spec, 2, 16, security=reader) as src:
        assert len(src.micro_batches(0)) == 8
    with ServiceBatchSource(
        [data_service],
        spec,
        2,
        16,
        security=ClientSecurity.from_files(token_files["wrong"]),
        give_up_s=60,
    ) as src:
        with pytest.raises(DataError, match="UNAUTHENTICATED: .*not one this server accepts"):
            src.micro_batches(0)  # not retried for give_up_s: no other worker would take it either


@pytest.fixture
def ckpt_service(tmp_path, token_files):
    server, port, _ = ckpt_server.start_server(
        str(tmp_path / "ckpt"), security=ServerSecurity.from_files(token_files["server"])
    )
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _client(address, scope, token_files):
    return CheckpointClient(
        address, chunk_bytes=256, security=ClientSecurity.from_files(token_files[scope])
    )


def _save(client, step, overwrite=False):
    from meshtrain.services.checkpoint.boxes import ShardSpec

    save_id = client.begin_save(step, num_writers=1, overwrite=overwrite)
    writer = client.writer(step, save_id, 0, 1)
    import torch

    writer.write(ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2))
    writer.finish()
    return client.commit(step, save_id, 1)


def test_checkpoint_scopes(ckpt_service, token_files):
    with grpc.insecure_channel(ckpt_service) as channel:
        stub = ckpt_grpc.CheckpointServiceStub(channel)
        code, details = _code(lambda: stub.List(ckpt_pb.ListRequest(), timeout=10))
        assert (
            code == grpc.StatusCode.UNAUTHENTICATED
            and "List needs a bearer token with scope read" in details
        )
        code, details = _code(
            lambda: stub.Delete(
                ckpt_pb.DeleteRequest(step=1), timeout=10, metadata=_bearer("wrong")
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED and WRONG not in details
        code, details = _code(
            lambda: stub.BeginSave(
                ckpt_pb.BeginSaveRequest(step=1, num_writers=1),
                timeout=10,
                metadata=_bearer("read"),
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == (
            "/meshtrain.checkpoint.v1.CheckpointService/BeginSave needs scope write; "
            "the token sent has scope read"
        )
    with (
        _client(ckpt_service, "write", token_files) as writer,
        _client(ckpt_service, "read", token_files) as reader,
        _client(ckpt_service, "admin", token_files) as admin,
    ):
        assert _save(writer, 1).step == 1
        assert reader.list() == [1] and reader.describe(1)["arrays"]
        with pytest.raises(
            CheckpointError,
            match="PERMISSION_DENIED: .*WriteShards needs scope write; .*scope read",
        ):
            reader.writer(2, "some-save", 0, 1).finish()
        with pytest.raises(
            CheckpointError, match="PERMISSION_DENIED: .*BeginSave needs scope admin; .*scope write"
        ):
            writer.begin_save(
                1, num_writers=1, overwrite=True
            )  # replacing a committed step is admin's
        for call in (lambda c: c.delete(1), lambda c: c.apply_retention(keep_last=1)):
            with pytest.raises(
                CheckpointError, match="PERMISSION_DENIED: .*needs scope admin; .*scope write"
            ):
                call(writer)
        assert _save(admin, 1, overwrite=True).step == 1
        assert admin.delete(1) and admin.list() == []


def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(tmp_path, pki, token_files):
    cert, key = pki["server"]
    security = ServerSecurity.from_files(token_files["server"], tls_cert=cert, tls_key=key)
    server, port, _ = ckpt_server.start_server(str(tmp_path / "ckpt"), security=security)
    address = f"127.0.0.1:{port}"
    try:
        with CheckpointClient(
            address, security=ClientSecurity.from_files(token_files["read"], ca_file=pki["ca"])
        ) as c:
            assert c.list() == []
        with CheckpointClient(
            address, security=ClientSecurity.from_files(token_files["read"])
        ) as plain:
            with pytest.raises(Exception, match="UNAVAILABLE"):
                plain.list()
        assert grpc_serving(address, security=ClientSecurity(ca_file=pki["ca"]))
        assert not grpc_serving(address)
    finally:
        server.stop(0)


def test_mutual_tls_admits_only_certificates_of_the_client_ca(tmp_path, pki):
    cert, key = pki["server"]
    security = ServerSecurity.from_files(tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"])
    server, port, _ = ckpt_server.start_server(
        str(tmp_path / "ckpt"), host="0.0.0.0", security=security
    )
    address = f"127.0.0.1:{port}"
    try:
        client_cert, client_key = pki["client"]
        with CheckpointClient(
            address,
            chunk_bytes=256,
            security=ClientSecurity(ca_file=pki["ca"], cert_file=client_cert, key_file=client_key),
        ) as c:
            assert _save(c, 3).step == 3 and c.delete(
                3
            )  # a certificate of the client CA has every scope
        for who in ({}, dict(zip(("cert_file", "key_file"), pki["stranger"]))):
            with CheckpointClient(address, security=ClientSecurity(ca_file=pki["ca"], **who)) as c:
                with pytest.raises(Exception, match="UNAVAILABLE"):
                    c.list()
    finally:
        server.stop(0)


def _serve(host, security=None):
    return make_server([], ["x.v1.X"], port=0, host=host, security=security)


def test_an_address_beyond_loopback_needs_authentication_or_insecure(token_files):
    with pytest.raises(
        ConfigError,
        match=r"refusing to serve 0\.0\.0\.0:0 without authentication.*--token-file.*"
        r"--tls-client-ca.*--insecure",
    ):
        _serve("0.0.0.0")
    for security in (
        ServerSecurity(insecure=True),
        ServerSecurity.from_files(token_files["server"]),
    ):
        server, port, _ = _serve("0.0.0.0", security)
        assert port > 0
        server.stop(0)


@pytest.mark.e2e
def test_the_serve_commands_refuse_an_open_address_and_take_the_flags(tmp_path, token_files):
    import sys

    for argv in (
        ["data", "serve", "--host", "0.0.0.0"],
        ["ckpt", "serve", str(tmp_path), "--host", "0.0.0.0"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "meshtrain.services.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            out.returncode == 2
            and "refusing to serve 0.0.0.0:0 without authentication" in out.stderr
        ), out.stderr
