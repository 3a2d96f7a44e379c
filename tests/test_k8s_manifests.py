"""deploy/kubernetes: the kustomize base builds (here by a small builder that reads kustomization.yaml's
`resources` and `configMapGenerator`, and also with `kubectl kustomize` where kubectl is installed;
the kustomize binary has no PyPI or Debian package) and every object validates strictly against the
Kubernetes OpenAPI schemas (kubernetes-validate). The RBAC grants exactly what the publisher does."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from memtopo.addresses import parse_host_port
from memtopo.agent.config import parse_config
from memtopo.agent.k8s_publisher import GROUP, PLURAL

BASE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
K8S_VERSION = "1.37.0"
# What the builder implements; a kustomization using anything else must fail here, not build wrongly.
_KNOWN = {"apiVersion", "kind", "resources", "configMapGenerator"}


def build(base: Path) -> list[dict[str, Any]]:
    """The objects `kustomize build` makes of ``base``, for the features this base uses."""
    k = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(k) <= _KNOWN, f"kustomization uses {set(k) - _KNOWN}: extend the builder"
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        objs += [d for d in yaml.safe_load_all((base / res).read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        opts = gen.get("options", {})
        assert set(gen) <= {"name", "namespace", "files", "options"} and opts.get("disableNameSuffixHash") is True
        meta: dict[str, Any] = {"name": gen["name"], "namespace": gen["namespace"]}
        if opts.get("labels"):
            meta["labels"] = opts["labels"]
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                     "data": {Path(f).name: (base / f).read_text() for f in gen["files"]}})
    return objs


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


OBJECTS = build(BASE)
BY_KIND = {key(o): o for o in OBJECTS}


def one(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_the_base_has_what_a_deployment_needs() -> None:
    assert sorted(k[0] for k in BY_KIND) == sorted([
        "Namespace", "CustomResourceDefinition", "ServiceAccount", "ServiceAccount", "ClusterRole",
        "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Deployment", "Service"])
    assert len(BY_KIND) == len(OBJECTS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_kubectl_kustomize_builds_the_same_objects() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=120, check=True)
    built = {key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    assert built == BY_KIND


@pytest.mark.parametrize("k", sorted(BY_KIND), ids=["/".join(k) for k in sorted(BY_KIND)])
def test_every_object_validates_strictly(k: tuple[str, str, str]) -> None:
    kubernetes_validate.validate(BY_KIND[k], K8S_VERSION, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    ds = yaml.safe_load(yaml.safe_dump(one("DaemonSet", "memtopo-agent")))
    ds["spec"]["template"]["spec"]["hostPid"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_rbac_grants_exactly_the_publishers_verbs() -> None:
    rules = one("ClusterRole", "memtopo-agent")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(GROUP, PLURAL, "create"), (GROUP, PLURAL, "patch"), ("", "nodes", "get")}
    binding = one("ClusterRoleBinding", "memtopo-agent")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "memtopo-agent", "namespace": "memtopo"}]
    ds = one("DaemonSet", "memtopo-agent")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "memtopo-agent"


def test_the_crd_defines_the_nrt_api_under_its_published_names() -> None:
    crd = one("CustomResourceDefinition", f"{PLURAL}.{GROUP}")
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["group"] == GROUP
    assert crd["spec"]["names"] == {"kind": "NodeResourceTopology", "listKind": "NodeResourceTopologyList",
                                    "singular": "noderesourcetopology", "plural": PLURAL,
                                    "shortNames": ["node-res-topo"]}
    # A group under k8s.io is protected: without this annotation the API server refuses the CRD.
    assert crd["metadata"]["annotations"]["api-approved.kubernetes.io"].startswith("https://github.com/kubernetes/")
    versions = {v["name"]: (v["served"], v["storage"]) for v in crd["spec"]["versions"]}
    assert versions == {"v1alpha1": (True, False), "v1alpha2": (True, True)}
    schemas = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}
    assert schemas["v1alpha2"]["required"] == ["zones"] and "attributes" in schemas["v1alpha2"]["properties"]
    assert sorted(schemas["v1alpha1"]["required"]) == ["topologyPolicies", "zones"]
    assert "attributes" not in schemas["v1alpha1"]["properties"]
    assert schemas["v1alpha1"]["properties"]["zones"] == schemas["v1alpha2"]["properties"]["zones"]


def test_the_daemonset_runs_the_configmaps_agent_with_its_mounts_probes_and_scrape_port() -> None:
    ds = one("DaemonSet", "memtopo-agent")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["hostPID"] is False
    sec = c["securityContext"]
    assert sec["capabilities"] == {"drop": ["ALL"]} and sec["allowPrivilegeEscalation"] is False
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert set(host.values()) == {"/sys", "/run/memtopo", "/var/lib/memtopo", "/var/lib/kubelet/pod-resources",
                                  "/var/lib/kubelet/config.yaml"}
    assert all(mounts[name] == path for name, path in host.items())  # the host's paths, where the agent reads
    cm_name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    cm = one("ConfigMap", cm_name)
    assert c["command"][-1] == f"{mounts['config']}/agent.toml"
    cfg = parse_config(cm["data"]["agent.toml"], "configmap")
    assert cfg.kubernetes.enabled and cfg.apply.cgroup_prefixes == ()
    assert cfg.listen.socket.startswith(mounts["run"]) and cfg.state_dir == mounts["state"]
    assert cfg.kubernetes.pod_resources_socket.startswith(mounts["pod-resources"] + "/")
    _, port = parse_host_port(cfg.health.listen)
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    notes = ds["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_controller_deployment_and_service_agree_on_the_port() -> None:
    dep = one("Deployment", "memtopo-controller")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    listen = c["command"][c["command"].index("--listen") + 1]
    svc = one("Service", "memtopo-controller")
    (port,) = svc["spec"]["ports"]
    assert listen.endswith(f":{port['port']}") and port["targetPort"] == c["ports"][0]["name"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_the_containerfile_installs_every_package_the_project_ships() -> None:
    text = (BASE.parents[1] / "Containerfile").read_text()
    include = tomllib.loads((BASE.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
        "include"]
    for pattern in include:
        pkg = pattern.rstrip("*")
        assert f"COPY {pkg} ./{pkg}" in text, pkg
    assert "'.[k8s" in text
