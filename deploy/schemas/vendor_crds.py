"""Vendor the openAPIV3Schema of the custom resources deploy/ uses, from each project's own published CRD YAML.

    python deploy/schemas/vendor_crds.py OWNER/NAME GIT_DIR COMMIT PATH VERSION [PATH VERSION ...]

reads each CRD at COMMIT of GIT_DIR (a clone or bare mirror of github.com/OWNER/NAME), keeps only the
schema of VERSION with its descriptions removed (they are 60-80 % of the bytes and never validate anything), and
writes deploy/schemas/<group>_<kind>_<version>.json with a `$comment` naming the repository, commit and path.

Two subtrees are cut instead of copied, as kubectl's own validation treats them: a LeaderWorkerSet's pod templates
(the full core PodTemplateSpec, 0.5 MB) become `{"type": "object", "x-omnivox-pod-template": true}`, and
tests/deploy/test_deploy.py validates them as core/v1 PodTemplates with kubernetes-validate (strict) instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
POD_TEMPLATE = {"type": "object", "x-omnivox-pod-template": True}
# (kind, path of keys under the schema's root) of pod templates to cut.
POD_TEMPLATES = {
    "LeaderWorkerSet": [
        ("properties", "spec", "properties", "leaderWorkerTemplate", "properties", "leaderTemplate"),
        ("properties", "spec", "properties", "leaderWorkerTemplate", "properties", "workerTemplate"),
    ]
}


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def cut(schema: dict[str, Any], path: tuple[str, ...]) -> None:
    parent = schema
    for key in path[:-1]:
        parent = parent[key]
    assert path[-1] in parent, path
    parent[path[-1]] = dict(POD_TEMPLATE)


def vendor(repo: str, git_dir: str, commit: str, path: str, version: str) -> Path:
    commit = subprocess.run(
        ["git", "-C", git_dir, "rev-parse", commit], capture_output=True, text=True, check=True
    ).stdout.strip()
    text = subprocess.run(
        ["git", "-C", git_dir, "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    (crd,) = [d for d in yaml.safe_load_all(text) if d and d.get("kind") == "CustomResourceDefinition"]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = without_descriptions(served["schema"]["openAPIV3Schema"])
    for key_path in POD_TEMPLATES.get(kind, []):
        cut(schema, key_path)
    comment = (
        f"{group}/{version} {kind}: the openAPIV3Schema of {path} in github.com/{repo} at {commit} "
        "(Apache-2.0), descriptions removed (one line: data, not for reading), written by deploy/schemas/vendor_crds.py"
    )
    out = HERE / f"{group}_{kind}_{version}.json"
    out.write_text(json.dumps({"$comment": comment, **schema}, sort_keys=True, separators=(",", ":")) + "\n")
    return out


def main(argv: list[str]) -> None:
    repo, git_dir, commit, *pairs = argv
    for path, version in zip(pairs[::2], pairs[1::2], strict=True):
        print(vendor(repo, git_dir, commit, path, version))


if __name__ == "__main__":
    main(sys.argv[1:])
