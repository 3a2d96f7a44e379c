"""deploy/kubernetes as `kustomize build` makes it, for the tests: a small builder that reads
kustomization.yaml's `resources` and `configMapGenerator`, and a component's `patches` as strategic merge
patches (the kustomize binary has no PyPI or Debian package), and what the built RBAC grants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from memtopo.k8s.kubeapi import NRT_GROUP as GROUP
from memtopo.k8s.kubeapi import NRT_RESOURCE as PLURAL

BASE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
ENFORCE = BASE / "enforce"
K8S_VERSION = "1.37.0"
# What the builder implements; a kustomization using anything else must fail here, not build wrongly.
_KNOWN = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "components"}
# Strategic merge patch: the lists merged by key in the objects these patches touch (every other list
# in a patch fails the builder rather than being merged wrongly).
_MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name"}


def _generated(base: Path, gen: dict[str, Any]) -> dict[str, Any]:
    opts = gen.get("options", {})
    assert set(gen) <= {"name", "namespace", "files", "options", "behavior"} and opts.get("disableNameSuffixHash")
    meta: dict[str, Any] = {"name": gen["name"], "namespace": gen["namespace"]}
    if opts.get("labels"):
        meta["labels"] = opts["labels"]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {Path(f).name: (base / f).read_text() for f in gen["files"]}}


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """``patch`` applied to ``target`` as kustomize applies a strategic merge patch, for maps and the keyed
    lists in _MERGE_KEYS (None deletes a field)."""
    if isinstance(patch, dict) and isinstance(target, dict):
        out = dict(target)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(target.get(k), v, k)
        return out
    if isinstance(patch, list):
        assert field in _MERGE_KEYS, f"a patch of the list {field!r}: extend the builder"
        key, merged, added = _MERGE_KEYS[field], list(target or []), []
        for item in patch:
            at = next((i for i, old in enumerate(merged) if old[key] == item[key]), None)
            if at is None:
                added.append(item)
            else:
                merged[at] = strategic_merge(merged[at], item, field)
        return added + merged  # kustomize puts the items a patch adds first
    return patch


def build(base: Path, components: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The objects `kustomize build` makes of ``base`` with ``components`` (after those it names), for the
    features they use: resources (files, or directories holding a kustomization), ConfigMap generators,
    components of resources, generators that replace and strategic-merge patches."""
    k = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(k) <= _KNOWN - {"patches"}, f"kustomization uses {set(k) - _KNOWN}: extend the builder"
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = base / res
        objs += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    objs += [_generated(base, gen) for gen in k.get("configMapGenerator", [])]
    for comp in (*(base / c for c in k.get("components", [])), *components):
        c = yaml.safe_load((comp / "kustomization.yaml").read_text())
        assert c["kind"] == "Component" and set(c) <= _KNOWN - {"components"}, f"component uses {set(c) - _KNOWN}"
        for res in c.get("resources", []):
            objs += [d for d in yaml.safe_load_all((comp / res).read_text()) if d]
        for gen in c.get("configMapGenerator", []):
            assert gen["behavior"] == "replace"
            made = _generated(comp, gen)
            (at,) = [i for i, o in enumerate(objs) if key(o) == key(made)]
            objs[at] = made
        for entry in c.get("patches", []):
            assert set(entry) == {"path"}
            patch = yaml.safe_load((comp / entry["path"]).read_text())
            (at,) = [i for i, o in enumerate(objs) if key(o) == key(patch)]
            objs[at] = strategic_merge(objs[at], patch)
    return objs


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


OBJECTS = build(BASE)
BY_KIND = {key(o): o for o in OBJECTS}
ENFORCING = build(BASE, (ENFORCE,))
ENFORCING_BY_KIND = {key(o): o for o in ENFORCING}


def granted(objects: list[dict[str, Any]], account: str = "memtopo-agent") -> set[tuple[str, str, str]]:
    """(API group, resource, verb) the service account ``account`` is given by the ClusterRoles bound to it."""
    roles = {b["roleRef"]["name"] for b in objects if b["kind"] == "ClusterRoleBinding"
             and {"kind": "ServiceAccount", "name": account, "namespace": "memtopo"} in b["subjects"]}
    return {(g, r, v) for role in objects if role["kind"] == "ClusterRole" and role["metadata"]["name"] in roles
            for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


PUBLISHER_VERBS = {(GROUP, PLURAL, "create"), (GROUP, PLURAL, "patch"), ("", "nodes", "get")}
# What agent/k8s_pods.py calls: the informer's list and watch of pods, the status annotation's merge
# patch, the Events (tests/agent/test_agent_enforce_e2e.py checks these against the calls it saw).
ENFORCEMENT_VERBS = {("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "patch"), ("", "events", "create")}
