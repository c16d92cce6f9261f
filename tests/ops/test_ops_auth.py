"""Auth: API keys on unary and streaming RPCs (missing, wrong, right), health open, quotas with RetryInfo, and mTLS
with certificates this test makes (the `cryptography` package)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.checkpoints import make_checkpoint
from support.service_harness import ServerThread, user_request

from omnivox.services.cli.bearer import BearerKey
from omnivox.services.errors import Code, ServiceError
from omnivox.services.grpc_api.auth import Quota, QuotaBook, load_api_keys
from omnivox.services.grpc_api.rpc_errors import status_details
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def keyed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\nalice:{KEY}\nbob-key-abcdefgh\n")
    opts = dict(api_keys=keys, quota=Quota(max_concurrent=2))
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], EngineOptions(kv_cache_gib=0.01), **opts) as srv:
        yield srv


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_keys_on_unary_and_streaming_rpcs(keyed: ServerThread) -> None:
    ch = keyed.channel()
    models = model_pb2_grpc.ModelServiceStub(ch)
    gen = generation_pb2_grpc.GenerationServiceStub(ch)
    req = user_request("Hi", max_output_tokens=2)
    for metadata, want in [
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer wrong-key-000000"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", KEY),), grpc.StatusCode.UNAUTHENTICATED),  # no "Bearer "
        ((("authorization", f"Bearer {KEY}"),), grpc.StatusCode.OK),
        ((("authorization", "Bearer bob-key-abcdefgh"),), grpc.StatusCode.OK),
    ]:
        assert code_of(lambda m=metadata: models.ListModels(model_pb2.ListModelsRequest(), metadata=m)) == want
        assert code_of(lambda m=metadata: list(gen.Generate(req, metadata=m))) == want
    # Health and reflection stay open for probes.
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # The CLI's channel wrapper sends the key on every call.
    wrapped = grpc.intercept_channel(ch, BearerKey(KEY))
    out = list(generation_pb2_grpc.GenerationServiceStub(wrapped).Generate(req))
    assert out[-1].HasField("summary")


def test_concurrent_quota_answers_resource_exhausted_with_retry_info(
    keyed: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="omnivox.requests")
    gen = generation_pb2_grpc.GenerationServiceStub(keyed.channel())
    md = (("authorization", f"Bearer {KEY}"),)
    long = user_request("Talk.", max_output_tokens=4000, ignore_eos=True)
    streams = [gen.Generate(long, metadata=md) for _ in range(2)]
    for s in streams:
        assert next(s).HasField("delta")  # both admitted and running
    with pytest.raises(grpc.RpcError) as info:
        list(gen.Generate(user_request("Hi", max_output_tokens=2), metadata=md))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = [d for d in status_details(info.value) if d.DESCRIPTOR.name == "RetryInfo"]
    assert retry and retry[0].retry_delay.ToNanoseconds() > 0
    # Another caller is not limited by alice's streams.
    out = list(
        gen.Generate(user_request("Hi", max_output_tokens=2), metadata=(("authorization", "Bearer bob-key-abcdefgh"),))
    )
    assert out[-1].HasField("summary")
    for s in streams:
        s.cancel()
    keyed.wait_kv_free("tiny", timeout=5.0)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "omnivox.requests"]
    assert "alice" in {x["caller"] for x in lines}
    assert "RESOURCE_EXHAUSTED" in {x["status"] for x in lines}


def test_rate_quota_window() -> None:
    book = QuotaBook(Quota(max_per_minute=2))
    book.take("a", now=0.0)
    book.give_back("a")
    book.take("a", now=10.0)
    book.give_back("a")
    with pytest.raises(ServiceError) as info:
        book.take("a", now=20.0)
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    delay = info.value.details[0].retry_delay.ToNanoseconds() / 1e9
    assert delay == pytest.approx(40.0)  # the call at t=0 leaves the window at t=60
    book.take("b", now=20.0)  # per caller
    book.take("a", now=60.5)


def test_key_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_text("short\n")
    with pytest.raises(ValueError, match="at least 8"):
        load_api_keys(f)
    f.write_text("ops:abcdefgh12\n\nno-id-key-123\n")
    ids = sorted(load_api_keys(f).values())
    assert ids[1] == "ops" and len(ids[0]) == 8 and "no-id" not in ids[0]  # unnamed keys named by digest


# ---- mTLS -----------------------------------------------------------------------------------------------------------
def _cert(subject: str, key, issuer_name: x509.Name | None, issuer_key, ca: bool) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def test_mtls_requires_a_client_certificate_and_names_the_caller(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="omnivox.requests")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("omnivox test CA", ca_key, None, ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_cert = _cert("localhost", server_key, ca.subject, ca_key, ca=False)
    client_cert = _cert("carol", client_key, ca.subject, ca_key, ca=False)
    for name, obj in [("ca.pem", ca), ("server.pem", server_cert), ("server.key", server_key)]:
        (tmp_path / name).write_bytes(_pem(obj))
    opts = dict(tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.key", tls_client_ca=tmp_path / "ca.pem")
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], load=False, **opts) as srv:
        target = f"localhost:{srv.server.port}"
        good = grpc.secure_channel(target, grpc.ssl_channel_credentials(_pem(ca), _pem(client_key), _pem(client_cert)))
        out = model_pb2_grpc.ModelServiceStub(good).ListModels(model_pb2.ListModelsRequest(), timeout=10)
        assert [m.name for m in out.models] == ["tiny"]
        good.close()
        bare = grpc.secure_channel(target, grpc.ssl_channel_credentials(_pem(ca)))
        with pytest.raises(grpc.RpcError) as info:
            model_pb2_grpc.ModelServiceStub(bare).ListModels(model_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake itself fails: no RPC runs
        bare.close()
    callers = [json.loads(r.getMessage())["caller"] for r in caplog.records if r.name == "omnivox.requests"]
    assert callers == ["carol"]


ALICE_KEY = "alice-key-0123456789"


@pytest.fixture(scope="module")
def alice_served(tmp_path_factory):
    root = tmp_path_factory.mktemp("alice-keyed")
    spec = ModelSpec(path=make_checkpoint(root / "text"), name="text")
    (root / "keys").write_text(f"alice:{ALICE_KEY}\n")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01), api_keys=root / "keys") as server:
        yield server


def _generate(server: ServerThread, metadata: tuple) -> list:
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel())
    request = generation_pb2.GenerateRequest(
        max_output_tokens=2, contents=[content_pb2.Content(parts=[content_pb2.Part(text="Hi")])]
    )
    return list(stub.Generate(request, metadata=metadata, timeout=30))


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer "])
def test_the_bearer_scheme_is_case_insensitive(alice_served, scheme):
    """RFC 7235: the auth scheme is case-insensitive, and clients do send `authorization: bearer KEY`; it was refused
    as "missing API key"."""
    assert _generate(alice_served, (("authorization", f"{scheme} {ALICE_KEY}"),))[-1].HasField("summary")


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key"),
        (
            (("authorization", ALICE_KEY),),
            "the authorization header is not 'Bearer KEY'",
        ),  # was "missing API key"
        ((("authorization", "Basic YWxpY2U6eA=="),), "the authorization header is not 'Bearer KEY'"),
        ((("authorization", "Bearer wrong"),), "invalid API key"),
    ],
    ids=["none", "no-scheme", "basic", "wrong"],
)
def test_a_refused_key_says_what_was_wrong(alice_served, metadata, message):
    with pytest.raises(grpc.RpcError) as err:
        _generate(alice_served, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == f"{message}: send 'authorization: Bearer KEY'"


def test_health_list_answers_every_service(alice_served, caplog):
    """grpc.health.v1 Health/List (in health.proto since 2024; grpcurl and Kubernetes tooling call it) answered
    UNIMPLEMENTED "Unexpected <class 'NotImplementedError'>" and logged a traceback per call."""
    stub = health_pb2_grpc.HealthStub(alice_served.channel())
    statuses = stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
    serving = health_pb2.HealthCheckResponse.SERVING
    assert statuses[""].status == serving
    assert statuses["omnivox.v1.GenerationService"].status == serving
    assert statuses["model/text"].status == serving
    for name, status in statuses.items():  # List says what Check says
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == status.status
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Traceback" not in caplog.text
