"""Operations as a user sees them: every `omnivox serve` flag value out of range is a one-line error naming the flag;
metrics scraped and parsed as Prometheus does, gauges back to zero after cancelled, failed and refused calls; API key
files as operators write them, rotated without a restart, and never logged."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from support.checkpoints import make_checkpoint
from support.paths import REPO_ROOT
from support.service_harness import ServerThread, user_request

from omnivox.services.cli import build_parser
from omnivox.services.cli import main as cli_main
from omnivox.services.cli._serve_flags import check_flag_values
from omnivox.services.errors import ServiceError
from omnivox.services.grpc_api.auth import KeyFile, Quota, QuotaBook
from omnivox.services.grpc_api.tls import CertificateFiles
from omnivox.services.parts.loading import EngineOptions, ModelSpec
from omnivox.v1 import generation_pb2, generation_pb2_grpc, model_pb2, model_pb2_grpc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ops-config") / "tiny", family="llama", max_position_embeddings=4096)


# ---- CLI: every flag's value is checked, in one line naming the flag ---------------------------------------------
def _free_port() -> int:
    """A port nothing listens on now (bound to 0 and released): the flag checks below refuse it before any bind, and
    a fixed number (50999 was) could be in use by anything on a shared machine, changing the error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = str(_free_port())
BAD_FLAGS = [
    (["--max-connection-age", "nan"], "--max-connection-age"),  # was a ValueError traceback
    (["--max-connection-age", "inf"], "--max-connection-age"),  # OverflowError traceback
    (["--max-connection-age", "1e30"], "--max-connection-age"),  # OverflowError traceback
    (["--max-message-mib", "100000"], "--max-message-mib"),  # OverflowError traceback (gRPC's C int)
    (["--kv-cache-gib", "nan"], "--kv-cache-gib"),  # 'cannot convert float NaN to integer', no flag named
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--grace-period", "nan"], "--grace-period"),  # served, with no grace at all
    (["--stream-idle-timeout", "nan"], "--stream-idle-timeout"),  # served
    (["--max-streams-per-key", "-1"], "--max-streams-per-key"),  # served, refusing every call
    (["--max-rpm-per-key", "-1"], "--max-rpm-per-key"),  # served, refusing every call
    (["--image-cache-mib", "-1"], "--image-cache-mib"),  # served
    (["--max-request-megapixels", "0"], "--max-request-megapixels"),  # would refuse every image
    (["--max-model-len", "0"], "--max-model-len"),  # said 'max_model_len', not the flag
    (["--name", ""], "--name"),  # served a model named ''
    (["--device", "foo"], "--device"),  # torch's list of 20 device types, no flag named
    (["--data-dir", __file__], "--data-dir"),  # served; creating a voice failed later
    (["--port", PORT, "--metrics-port", PORT], "--metrics-port"),  # 'Address already in use' + a traceback
    (["--health-port", "70000"], "--health-port"),
    (["--port", PORT, "--health-port", PORT], "--health-port"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS, ids=[" ".join(f).replace(PORT, "PORT") for f, _ in BAD_FLAGS])
def test_serve_flag_out_of_range_is_one_line_naming_it(
    flags: list[str], named: str, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli_main(["serve", "--model", str(checkpoint), "--port", "0", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omnivox: error: ") and named in err[0], err


def test_serve_flag_error_from_the_command_line_has_no_traceback(checkpoint: Path) -> None:
    """The installed command, as a user runs it: exit 1, one line on stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "omnivox.services.cli", "serve", "--model", str(checkpoint), "--max-connection-age",
         "inf"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"omnivox: error: --max-connection-age must be a number greater than 0 and at most {2**31 // 1000 - 1}, "
        f"got {math.inf:g}"
    ]


def test_metrics_port_in_use_is_one_line_and_no_traceback(checkpoint: Path) -> None:
    """The gRPC server had started when the metrics port failed to bind; left to the GC, it printed 'Exception ignored
    ... Event loop is closed' with a traceback after the error line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "omnivox.services.cli", "serve", "--model", str(checkpoint), "--port", "0",
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if " INFO " not in line and line.strip()]
    assert errors == [f"omnivox: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"], errors


# ---- API keys: files as operators write them, rotation without a restart, no key material in logs -------------------
OLD_KEY, NEW_KEY, BOM_KEY = "sk-old-0123456789", "sk-new-9876543210", "sk-bom-5555555555"


def test_bad_key_file_is_one_line_naming_the_flag(checkpoint: Path, tmp_path: Path, capsys) -> None:
    for name, data in [
        ("short", b"alice:short\n"),  # was a ValueError traceback from the server's start
        ("empty", b"# no keys yet\n"),
        ("utf16", "alice:sk-alice-0123456789\n".encode("utf-16")),  # PowerShell's `>`: a UnicodeDecodeError traceback
    ]:
        (tmp_path / name).write_bytes(data)
        assert cli_main(["serve", "--model", str(checkpoint), "--port", "0", "--api-keys", str(tmp_path / name)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("omnivox: error: --api-keys: "), err
        assert "sk-alice" not in err[0]


def write_atomically(path: Path, text: str) -> None:
    """As Kubernetes updates a mounted Secret and editors save: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(text.encode())
    tmp.replace(path)


@pytest.fixture(scope="module")
def keyed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    # Windows Notepad's UTF-8: a byte order mark first, CRLF line ends; the first key had the BOM in it.
    keys.write_bytes(b"\xef\xbb\xbf" + f"{BOM_KEY}\r\nops: {OLD_KEY} \r\n".encode())
    spec = ModelSpec(path=checkpoint, name="tiny")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01), api_keys=keys, metrics_port=0) as srv:
        yield srv, keys


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def list_models_code(srv: ServerThread, key: str) -> grpc.StatusCode:
    stub = model_pb2_grpc.ModelServiceStub(srv.channel())
    try:
        stub.ListModels(model_pb2.ListModelsRequest(), metadata=bearer(key), timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_keys_rotate_without_restart_and_never_reach_the_log(keyed, monkeypatch, caplog) -> None:
    srv, keys = keyed
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(KeyFile, "RECHECK_S", 0.05)
    ok, unauthenticated = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
    assert list_models_code(srv, BOM_KEY) == ok  # was UNAUTHENTICATED: the digest held the BOM
    assert list_models_code(srv, OLD_KEY) == ok
    assert list_models_code(srv, "sk-nobody-000000") == unauthenticated

    write_atomically(keys, f"ops:{NEW_KEY}\n")  # rotate: the old key out, the new one in, no restart
    deadline = time.monotonic() + 5
    while list_models_code(srv, NEW_KEY) != ok and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list_models_code(srv, NEW_KEY) == ok
    assert list_models_code(srv, OLD_KEY) == unauthenticated

    write_atomically(keys, "ops:short\n")  # a broken file: logged, the keys before stay in force
    time.sleep(0.1)
    assert list_models_code(srv, NEW_KEY) == ok
    time.sleep(0.1)
    assert list_models_code(srv, NEW_KEY) == ok
    assert "API keys not reloaded" in caplog.text
    gen = generation_pb2_grpc.GenerationServiceStub(srv.channel())
    out = list(gen.Generate(user_request("Hi", max_output_tokens=2), metadata=bearer(NEW_KEY), timeout=30))
    assert out[-1].HasField("summary")
    for key in (BOM_KEY, OLD_KEY, NEW_KEY, "sk-nobody-000000"):
        assert key not in caplog.text


# ---- Metrics as Prometheus scrapes them -------------------------------------------------------------------------------
UNLABELLED = {"omnivox_grpc_requests"}  # per RPC method and status, not per model


def scrape(srv: ServerThread, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{srv.server.metrics_port}/metrics")
    if accept:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def samples(srv: ServerThread) -> dict[tuple[str, tuple], float]:
    """Every sample of a text-format scrape, checked as a dashboard needs it."""
    _, body = scrape(srv)
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(body):
        assert family.name.startswith("omnivox_"), family.name
        for s in family.samples:
            if family.name.removesuffix("_created") not in UNLABELLED:  # the text format types _created a gauge
                assert s.labels.get("model"), (family.name, s)
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        if family.type == "histogram":
            series: dict[tuple, list[tuple[float, float]]] = {}
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                    series.setdefault(key, []).append((float(s.labels["le"]), s.value))
            for key, buckets in series.items():
                bounds = [b for b, _ in buckets]
                assert bounds == sorted(bounds) and bounds[-1] == math.inf, (family.name, bounds)
                assert [c for _, c in buckets] == sorted(c for _, c in buckets), (family.name, key)  # cumulative
    return out


def test_metrics_parse_counters_only_grow_and_gauges_return_to_zero(keyed) -> None:
    srv, _ = keyed
    gen = generation_pb2_grpc.GenerationServiceStub(srv.channel())
    md = bearer(next(k for k in (OLD_KEY, NEW_KEY) if list_models_code(srv, k) == grpc.StatusCode.OK))  # rotated?
    start = samples(srv)
    warm = list(gen.Generate(user_request("Warm up.", max_output_tokens=3), metadata=md, timeout=30))[-1].summary
    before = samples(srv)
    tiny = (("model", "tiny"),)
    for name, tokens in (("prompt", warm.usage.prompt_tokens), ("generation", warm.usage.output_tokens)):
        family = f"omnivox_request_{name}_tokens"  # per-request token histograms, as vLLM's
        assert before[(f"{family}_count", tiny)] - start.get((f"{family}_count", tiny), 0) == 1
        assert before[(f"{family}_sum", tiny)] - start.get((f"{family}_sum", tiny), 0) == tokens > 0

    # Traffic that ends every way but OK: cancelled mid-stream, past its deadline, refused, unauthenticated.
    call = gen.Generate(user_request("Talk on. " * 8, max_output_tokens=4000, ignore_eos=True), metadata=md)
    next(call)
    deadline = time.monotonic() + 5  # the gauges are set at the end of a step, after its tokens went out
    while (busy := samples(srv))[("omnivox_num_requests_running", (("model", "tiny"),))] != 1:
        assert time.monotonic() < deadline, busy
        time.sleep(0.01)
    assert busy[("omnivox_kv_cache_usage_perc", (("model", "tiny"),))] > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(gen.Generate(user_request("Long.", max_output_tokens=4000, ignore_eos=True), metadata=md, timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as info:
        list(gen.Generate(user_request("Bad.", max_output_tokens=-1), metadata=md, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        list(gen.Generate(user_request("Who?", max_output_tokens=2), metadata=bearer("sk-nobody-000000"), timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    srv.wait_kv_free("tiny", timeout=5.0)

    def generate_calls(snapshot: dict) -> float:
        return sum(v for (name, labels), v in snapshot.items() if name == "omnivox_grpc_requests_total"
                   and dict(labels)["method"] == "Generate")  # fmt: skip

    deadline = time.monotonic() + 5  # a call's status is counted when its server handler ends, after the client's
    while generate_calls(after := samples(srv)) < generate_calls(before) + 4:
        assert time.monotonic() < deadline, after
        time.sleep(0.02)
    for gauge in ("omnivox_num_requests_running", "omnivox_num_requests_waiting", "omnivox_kv_cache_usage_perc"):
        assert after[(gauge, tiny)] == 0, gauge
    for key, v in before.items():  # counters and histogram series never go down
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[key] >= v, key
    # The cancelled request counts as finished_reason="abort", as vLLM counts it and the README says (it was not
    # counted at all: a dashboard of requests by finish reason saw none). The timed-out one too when its deadline
    # found it in the engine (on a loaded machine it may pass while the prompt is still being built).
    abort = ("omnivox_request_success_total", (("finished_reason", "abort"), ("model", "tiny")))
    assert after[abort] - before.get(abort, 0) in (1, 2)
    codes = {dict(k[1])["grpc_code"] for k in after if k[0] == "omnivox_grpc_requests_total"}
    assert {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= codes

    # OpenMetrics when the scraper asks for it (Prometheus does by default), parsed by its strict parser.
    content_type, body = scrape(srv, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    names = {f.name for f in openmetrics_families(body)}
    assert {"omnivox_prompt_tokens", "omnivox_time_to_first_token_seconds", "omnivox_request_success"} <= names


# ---- TLS: foreign and expired client certificates, server certificates renewed without a restart -------------------
def make_cert(subject: str, key, issuer: x509.Certificate | None = None, issuer_key=None, days: float = 1.0):
    """A certificate for `subject` signed by `issuer` (self-signed CA without one), valid from a day ago for `days`
    (negative: expired)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=1 + days))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Authority:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = make_cert(name, self.key)

    def issue(self, subject: str, days: float = 1.0) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM)."""
        key = ec.generate_private_key(ec.SECP256R1())
        return pem(make_cert(subject, key, self.cert, self.key, days)), pem(key)


def list_models_over_tls(port: int, root: bytes, client: tuple[bytes, bytes] | None = None) -> grpc.StatusCode:
    cert, key = client or (None, None)
    with grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(root, key, cert)) as channel:
        try:
            model_pb2_grpc.ModelServiceStub(channel).ListModels(model_pb2.ListModelsRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_mtls_refuses_foreign_and_expired_client_certificates_and_server_certificates_rotate(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CertificateFiles, "RECHECK_S", 0.0)
    ours, foreign, renewed = Authority("our CA"), Authority("someone else's CA"), Authority("our next CA")
    cert, key = ours.issue("localhost")
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    (tmp_path / "clients.pem").write_bytes(pem(ours.cert))
    opts = dict(
        tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.key", tls_client_ca=tmp_path / "clients.pem"
    )
    ok, refused = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE  # refused in the handshake: no RPC runs
    with ServerThread([ModelSpec(path=checkpoint, name="tiny")], load=False, **opts) as srv:
        port = srv.server.port
        root = pem(ours.cert)
        assert list_models_over_tls(port, root, ours.issue("carol")) == ok
        assert list_models_over_tls(port, root, foreign.issue("mallory")) == refused
        assert list_models_over_tls(port, root, ours.issue("carol", days=-0.5)) == refused  # expired
        assert list_models_over_tls(port, root) == refused  # none

        # Renewal: new server certificate (from a new CA, so the test can tell them apart) and key written in place.
        cert, key = renewed.issue("localhost")
        write_atomically(tmp_path / "server.key", key.decode())
        write_atomically(tmp_path / "server.pem", cert.decode())
        assert list_models_over_tls(port, pem(renewed.cert), ours.issue("carol")) == ok  # was refused: the old one
        assert list_models_over_tls(port, root, ours.issue("carol")) == refused


# ---- Health: Check and Watch per service name through loading, serving and draining -------------------------------
def test_health_watch_follows_load_serve_and_drain_per_service(checkpoint: Path) -> None:
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    spec = ModelSpec(path=checkpoint, name="tiny")
    srv = ServerThread([spec], EngineOptions(kv_cache_gib=0.01), load=False, metrics_port=0)
    with srv:
        health = health_pb2_grpc.HealthStub(srv.channel())
        names = ["", "omnivox.v1.GenerationService", "model/tiny"]
        watches = {name: health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60) for name in names}
        assert next(watches[""]).status == NOT_SERVING  # loading: probes keep the pod out of the endpoints
        assert next(watches["omnivox.v1.GenerationService"]).status == NOT_SERVING
        assert next(watches["model/tiny"]).status == UNKNOWN  # known once its load ends
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

        srv.run(srv.server.load_models(srv.engine_options), timeout=120)
        for name in names:  # each watch streams the change, not only the status at its start
            assert next(watches[name]).status == SERVING, name
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == SERVING
        # A replica that has served nothing yet exports its engine series at 0 (they appeared with its first call:
        # the autoscaler's average and absent() alerts saw no series).
        fresh = samples(srv)
        for name in ("omnivox_num_requests_waiting", "omnivox_num_requests_running", "omnivox_kv_cache_usage_perc"):
            assert fresh[(name, (("model", "tiny"),))] == 0, name
        assert fresh[("omnivox_generation_tokens_total", (("model", "tiny"),))] == 0
        listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {n: s.status for n, s in listed.items() if n in names} == dict.fromkeys(names, SERVING)

        # Drain with a call in flight: every name turns NOT_SERVING at once, while the call still runs.
        gen = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        call = gen.Generate(user_request("Talk on.", max_output_tokens=4000, ignore_eos=True), timeout=60)
        next(call)
        stopping = srv.run_async(srv.server.stop(30.0))
        for name in names:
            assert next(watches[name]).status == NOT_SERVING, name
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
        assert not stopping.done()
        call.cancel()
        stopping.result(timeout=30)


# ---- Deploy: the values the manifests and the image pass are ones `omnivox serve` accepts ----------------------------
def test_manifest_and_image_flag_values_pass_the_serve_checks() -> None:
    """tests/deploy/test_deploy.py parses the flags; this checks their values as `omnivox serve` would at start (a
    --max-connection-age or --grace-period out of range is caught here, not by a pod in CrashLoopBackOff)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (kubectl kustomize renders the overlays)")
    root = REPO_ROOT
    argvs = [["serve", "--host", "0.0.0.0", "--port", "50051"]]  # docker/Dockerfile's CMD (test_deploy pins it)
    for overlay in sorted((root / "deploy" / "overlays").iterdir()):
        out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for doc in yaml.safe_load_all(out.stdout):
            if doc and doc["kind"] == "Deployment":
                argvs += [c["args"] for c in doc["spec"]["template"]["spec"]["containers"]]
    assert len(argvs) >= 4
    for argv in argvs:
        args = build_parser().parse_args(argv)
        args.device = None  # cuda exists on the GPU node the overlay schedules on, not necessarily here
        check_flag_values(args)  # CliError names the flag


def test_bad_tls_files_are_one_line_naming_the_flag(checkpoint: Path, tmp_path: Path, capsys) -> None:
    """gRPC said 'cannot listen on 127.0.0.1:0: Failed to bind to address' for each of these."""
    ca = Authority("our CA")
    cert, key = ca.issue("localhost")
    _, other_key = ca.issue("someone else")
    files = {"cert": cert, "key": key, "other.key": other_key, "garbage": b"not a certificate\n", "ca": pem(ca.cert)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    base = ["serve", "--model", str(checkpoint), "--port", "0"]
    for flags, named in [
        (["--tls-cert", "garbage", "--tls-key", "key"], "--tls-cert"),
        (["--tls-cert", "cert", "--tls-key", "garbage"], "--tls-key"),
        (["--tls-cert", "cert", "--tls-key", "other.key"], "the key is not the certificate's"),
        (["--tls-cert", "cert", "--tls-key", "key", "--tls-client-ca", "garbage"], "--tls-client-ca"),
    ]:
        argv = [str(tmp_path / f) if not f.startswith("--") else f for f in flags]
        assert cli_main([*base, *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0] and "Failed to bind" not in err[0], err


# ---- Quotas: a call's slot comes back however it ends ------------------------------------------------------------------
def test_quota_slot_comes_back_after_every_kind_of_end(checkpoint: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"ops:{OLD_KEY}\n")
    spec = ModelSpec(path=checkpoint, name="tiny")
    with ServerThread([spec], EngineOptions(kv_cache_gib=0.01), api_keys=keys, quota=Quota(max_concurrent=1)) as srv:
        gen = generation_pb2_grpc.GenerationServiceStub(srv.channel())
        md = bearer(OLD_KEY)
        long = user_request("Talk on.", max_output_tokens=4000, ignore_eos=True)

        def slot_is_free() -> bool:
            """A short call succeeds within 3 s (the slot is given back when the server's handler ends)."""
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    list(gen.Generate(user_request("Hi", max_output_tokens=1), metadata=md, timeout=10))
                    return True
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                    time.sleep(0.05)
            return False

        call = gen.Generate(long, metadata=md)
        next(call)
        with pytest.raises(grpc.RpcError) as info:  # the quota holds while the first runs
            list(gen.Generate(user_request("Hi", max_output_tokens=1), metadata=md, timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        assert slot_is_free(), "after a client cancel"
        with pytest.raises(grpc.RpcError):
            list(gen.Generate(long, metadata=md, timeout=0.3))
        assert slot_is_free(), "after a deadline"
        with pytest.raises(grpc.RpcError):
            list(gen.Generate(user_request("Bad.", max_output_tokens=-1), metadata=md, timeout=10))
        assert slot_is_free(), "after INVALID_ARGUMENT"
        closing = grpc.insecure_channel(srv.address)
        call = generation_pb2_grpc.GenerationServiceStub(closing).Generate(long, metadata=md)
        next(call)
        closing.close()  # the client goes away without a cancel of its own
        assert slot_is_free(), "after the client's channel closed"
        srv.wait_kv_free("tiny", timeout=5.0)


def test_health_port_answers_plaintext_probes_of_a_tls_server(checkpoint: Path, tmp_path: Path) -> None:
    """Kubernetes' gRPC probes and the image's HEALTHCHECK speak plaintext only: against a TLS (or mTLS) port they
    always failed. --health-port serves the same health service alone, in plaintext."""
    ca = Authority("our CA")
    cert, key = ca.issue("localhost")
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    (tmp_path / "clients.pem").write_bytes(pem(ca.cert))
    opts = dict(
        tls_cert=tmp_path / "server.pem", tls_key=tmp_path / "server.key", tls_client_ca=tmp_path / "clients.pem"
    )
    spec = ModelSpec(path=checkpoint, name="tiny")
    srv = ServerThread([spec], EngineOptions(kv_cache_gib=0.01), load=False, health_port=0, **opts)
    with srv:
        probe = grpc.insecure_channel(f"127.0.0.1:{srv.server.health_port}")
        health = health_pb2_grpc.HealthStub(probe)
        request = health_pb2.HealthCheckRequest()
        assert health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING  # loading
        watch = health.Watch(request, timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        srv.run(srv.server.load_models(srv.engine_options), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        assert health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # only health there: no way around TLS and keys
            model_pb2_grpc.ModelServiceStub(probe).ListModels(model_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        plain = grpc.insecure_channel(f"127.0.0.1:{srv.server.port}")  # the TLS port itself refuses plaintext
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(plain).Check(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()
        srv.run(srv.server.stop(5.0))
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # the drain, seen by the probe
        probe.close()


def test_every_omnivox_method_of_every_cardinality_needs_a_key(keyed) -> None:
    """Each RPC as its proto declares it (unary, server-streaming, bidirectional), with no key and a wrong one:
    UNAUTHENTICATED before any handler runs, whatever the request holds."""
    from google.protobuf import message_factory

    from omnivox.v1 import speech_pb2, transcription_pb2

    srv, _ = keyed
    channel = srv.channel()
    seen = 0
    for module in (generation_pb2, model_pb2, speech_pb2, transcription_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                request_cls = message_factory.GetMessageClass(method.input_type)
                path = f"/{service.full_name}/{method.name}"
                kind = ("stream" if method.client_streaming else "unary") + "_"
                kind += "stream" if method.server_streaming else "unary"
                rpc = getattr(channel, kind)(path, request_serializer=lambda m: m.SerializeToString())
                for metadata in ((), bearer("sk-nobody-000000")):
                    request = iter([request_cls()]) if method.client_streaming else request_cls()
                    with pytest.raises(grpc.RpcError) as info:
                        out = rpc(request, metadata=metadata, timeout=10)
                        if method.server_streaming:
                            list(out)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (path, metadata)
                seen += 1
    assert seen >= 9  # Generate, ListModels, five speech and two transcription methods


def test_quota_without_keys_or_certificates_says_it_is_the_servers() -> None:
    """With neither, every call is one anonymous caller; the refusal said "caller '' has 1 calls in flight"."""
    book = QuotaBook(Quota(max_concurrent=1))
    book.take("")
    with pytest.raises(ServiceError) as info:
        book.take("")
    assert "all callers together" in str(info.value) and "''" not in str(info.value)
    book.take("alice")
    with pytest.raises(ServiceError) as info:
        book.take("alice")
    assert "caller 'alice': 1 calls in flight" in str(info.value)
