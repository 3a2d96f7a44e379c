"""The NodeResourceTopology CRD (deploy/kubernetes/noderesourcetopologies.yaml) as the API server
applies it: the v1alpha2 schema an object is validated against, the fields it would prune, and
readers of an object's zones. Shared by the k8s tests and the stand-in API server."""

from __future__ import annotations

from functools import cache
from typing import Any

import yaml
from jsonschema import Draft7Validator

from bench.roots import REPO

CRD = REPO / "deploy" / "kubernetes" / "noderesourcetopologies.yaml"


@cache
def nrt_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v2,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema: dict[str, Any] = v2["schema"]["openAPIV3Schema"]
    return schema


def pruned(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would silently prune (not in the structural schema)."""
    out: list[str] = []
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += pruned(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            out += pruned(item, schema["items"], f"{path}[{i}]")
    return out


def assert_valid(obj: dict[str, Any]) -> None:
    schema = nrt_schema()
    errors = sorted(Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    assert pruned(obj, schema) == []


def zone(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(z for z in obj["zones"] if z["name"] == name)


def res(obj: dict[str, Any], zone_name: str, resource: str) -> tuple[str, str, str]:
    r = next(r for r in zone(obj, zone_name)["resources"] if r["name"] == resource)
    return r["capacity"], r["allocatable"], r["available"]
