"""The custom resources deploy/ ships pass their projects' own CRD schemas (vendored in deploy/schemas/ from the
upstream CRD YAML), and those checks can fail: a misspelt field, a wrong enum or type is refused, as a strict
`kubectl apply` would refuse it."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from support.deploy_manifests import CRD_SCHEMAS, DEPLOY, OVERLAYS, render, render_overlay, validate, with_typo

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def custom_resources() -> dict[tuple[str, str], dict[str, Any]]:
    """One rendered instance of every custom resource kind the overlays use."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for overlay in OVERLAYS:
        for doc in render_overlay(overlay):
            if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
                found.setdefault((doc["apiVersion"], doc["kind"]), doc)
    return found


def test_every_vendored_schema_is_used_and_says_where_it_is_from(custom_resources) -> None:
    assert set(custom_resources) == set(CRD_SCHEMAS)
    for (api_version, kind), name in CRD_SCHEMAS.items():
        schema = json.loads((DEPLOY / "schemas" / name).read_text())
        assert schema["$comment"].startswith(f"{api_version} {kind}: the openAPIV3Schema of "), name
        assert " in github.com/" in schema["$comment"] and "(Apache-2.0)" in schema["$comment"], name
        assert {"apiVersion", "kind", "spec"} <= set(schema["properties"]), name


# (kind, path to an object in it, misspelt field) per custom resource kind.
TYPOS = {
    "GRPCRoute": (["spec", "rules", 0, "matches", 0, "method"], "servce"),
    "PodMonitor": (["spec", "podMetricsEndpoints", 0], "prot"),
    "ScaledObject": (["spec"], "maxReplicas"),
    "BackendTrafficPolicy": (["spec", "loadBalancer", "consistentHash"], "header_name"),
    "LeaderWorkerSet": (["spec", "leaderWorkerTemplate"], "groupSize"),
    "Certificate": (["spec"], "dnsName"),
    "Issuer": (["spec", "ca"], "secret"),
}


@pytest.mark.parametrize("kind", sorted(TYPOS))
def test_a_misspelt_field_is_refused(custom_resources, kind: str) -> None:
    (doc,) = [d for (_, k), d in custom_resources.items() if k == kind]
    validate(doc)
    path, field = TYPOS[kind]
    with pytest.raises(jsonschema.ValidationError, match=field):
        validate(with_typo(doc, path, field))


def test_a_wrong_value_is_refused(custom_resources) -> None:
    """Enums and types of the upstream schema hold: a load balancer type Envoy Gateway does not have, a string count."""
    policy = next(d for (_, k), d in custom_resources.items() if k == "BackendTrafficPolicy")
    bad = json.loads(json.dumps(policy))
    bad["spec"]["loadBalancer"]["type"] = "SessionHash"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    scaled = next(d for (_, k), d in custom_resources.items() if k == "ScaledObject")
    bad = json.loads(json.dumps(scaled))
    bad["spec"]["maxReplicaCount"] = "16"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_the_oci_component_renders_and_validates(tmp_path) -> None:
    """components/models-from-oci over the cpu overlay: the Job copies the model image onto the volume first."""
    overlay, component = (os.path.relpath(DEPLOY / p, tmp_path) for p in ("overlays/cpu", "components/models-from-oci"))
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{overlay}]\ncomponents: [{component}]\n"
    )
    docs = render(tmp_path)
    for doc in docs:
        validate(doc)
    (job,) = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Job"]
    (copy,) = job["initContainers"]
    env = {e["name"]: e["value"] for e in job["containers"][0]["env"]}
    assert env["MODEL_SOURCE"] == "file:///models/.staging" and "/models/.staging" in copy["command"][-1]
    assert env["MODEL_ID"] == copy["image"]


def test_a_pod_template_cut_from_the_schema_is_still_checked(custom_resources) -> None:
    """The LeaderWorkerSet's pod templates (cut from the vendored schema) are validated as core PodTemplates,
    strictly: a misspelt probe field in the worker template is refused."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    lws = next(d for (_, k), d in custom_resources.items() if k == "LeaderWorkerSet")
    path = ["spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(with_typo(lws, path, "imagePullPolcy"))
