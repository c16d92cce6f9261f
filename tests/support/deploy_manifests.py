"""Shared by the deploy tests: render a kustomize overlay, and validate one rendered document, strictly: core kinds
with kubernetes-validate (pinned Kubernetes), custom resources against their projects' own CRD schemas vendored in
deploy/schemas/ (deploy/schemas/vendor_crds.py says from where).

A CRD schema alone is lenient where the API server is not: the server prunes unknown fields silently (or refuses them
with `kubectl apply --validate=strict`), which plain JSON Schema would let through. `strict_schema` adds
`additionalProperties: false` to every object schema that lists its properties and does not preserve unknown fields,
so a misspelt field fails here as it fails a strict apply. CEL rules (x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.paths import REPO_ROOT

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.33.0"  # the oldest we promise (preStop sleep, gRPC probes, PDB eviction policy are GA)
# Custom resources deploy/ uses, (apiVersion, kind) -> the vendored schema.
CRD_SCHEMAS = {
    (f"{group}/{version}", kind): f"{group}_{kind}_{version}.json"
    for group, kind, version in [
        ("gateway.networking.k8s.io", "GRPCRoute", "v1"),
        ("monitoring.coreos.com", "PodMonitor", "v1"),
        ("keda.sh", "ScaledObject", "v1alpha1"),
        ("gateway.envoyproxy.io", "BackendTrafficPolicy", "v1alpha1"),
        ("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "v1"),
        ("cert-manager.io", "Certificate", "v1"),
        ("cert-manager.io", "Issuer", "v1"),
    ]
}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not installed (kubectl kustomize renders the overlays)")
    return path


def render(directory: Path, *flags: str) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", *flags, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_overlay(overlay: str) -> list[dict[str, Any]]:
    return render(DEPLOY / "overlays" / overlay)


def strict_schema(node: Any) -> Any:
    """The schema with unknown fields refused where the API server would prune them (see the module docstring);
    OpenAPI's `nullable` as JSON Schema's null type."""
    if isinstance(node, list):
        return [strict_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    return strict_schema(json.loads((DEPLOY / "schemas" / CRD_SCHEMAS[api_version, kind]).read_text()))


def pod_templates(schema: dict[str, Any], doc: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """The (path, value) of every pod template the vendored schema cut out (x-omnivox-pod-template) found in doc."""
    if schema.get("x-omnivox-pod-template"):
        return [(path, doc)] if isinstance(doc, dict) else []
    found = []
    if isinstance(doc, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                found += pod_templates(sub, doc[key], f"{path}.{key}")
    return found


def validate(doc: dict[str, Any]) -> None:
    """Raise (jsonschema / kubernetes_validate ValidationError) unless doc is valid, strictly."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    key = (doc["apiVersion"], doc["kind"])
    if key not in CRD_SCHEMAS:  # raises ValidationError (strict: unknown fields too) or SchemaNotFoundError
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    schema = crd_schema(*key)
    jsonschema.Draft4Validator(schema).validate(doc)
    for path, template in pod_templates(schema, doc):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": path}, "template": template}
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def with_typo(doc: dict[str, Any], path: list[str | int], field: str) -> dict[str, Any]:
    """A copy of doc with an unknown field `field` added to the object at `path`."""
    out = copy.deepcopy(doc)
    node = out
    for key in path:
        node = node[key]
    node[field] = "x"
    return out
