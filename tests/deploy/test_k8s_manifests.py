"""deploy/kubernetes: the kustomize base builds (here by a small builder that reads kustomization.yaml's
`resources` and `configMapGenerator`, and a component's `patches` as strategic merge patches, and also
with `kubectl kustomize` where kubectl is installed; the kustomize binary has no PyPI or Debian package)
and every object validates strictly against the Kubernetes OpenAPI schemas (kubernetes-validate). The
base's RBAC grants exactly what the publisher does; the enforce component adds exactly what the
enforcement does. The shipped agent.toml publishes with no controller configured."""

from __future__ import annotations

import asyncio
import dataclasses
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
from memtopo.k8s.kubeapi import NRT_GROUP as GROUP
from memtopo.k8s.kubeapi import NRT_RESOURCE as PLURAL
from tests.kustomize import (
    BASE,
    BY_KIND,
    ENFORCEMENT_VERBS,
    ENFORCING,
    ENFORCING_BY_KIND,
    K8S_VERSION,
    OBJECTS,
    PUBLISHER_VERBS,
    granted,
    key,
)


def one(kind: str, name: str, objects: list[dict[str, Any]] = OBJECTS) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj



def test_the_base_has_what_a_deployment_needs() -> None:
    assert sorted(k[0] for k in BY_KIND) == sorted([
        "Namespace", "CustomResourceDefinition", "ServiceAccount", "ServiceAccount", "ClusterRole",
        "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Deployment", "Service"])
    assert len(BY_KIND) == len(OBJECTS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_kubectl_kustomize_builds_the_same_objects(tmp_path: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=120, check=True)
    built = {key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    assert built == BY_KIND
    # kustomize takes relative roots only: the base and an operator's kustomization side by side.
    shutil.copytree(BASE, tmp_path / "base")
    (tmp_path / "use").mkdir()
    (tmp_path / "use" / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n- ../base\ncomponents:\n- ../base/enforce\n")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path / "use")], capture_output=True, text=True,
                         timeout=120, check=True)
    assert {key(o): o for o in yaml.safe_load_all(out.stdout) if o} == ENFORCING_BY_KIND


ALL = sorted({("base", k) for k in BY_KIND} | {("enforce", k) for k in ENFORCING_BY_KIND})


@pytest.mark.parametrize(("build_of", "k"), ALL, ids=[f"{b}:{'/'.join(k)}" for b, k in ALL])
def test_every_object_validates_strictly(build_of: str, k: tuple[str, str, str]) -> None:
    kubernetes_validate.validate((BY_KIND if build_of == "base" else ENFORCING_BY_KIND)[k], K8S_VERSION, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    ds = yaml.safe_load(yaml.safe_dump(one("DaemonSet", "memtopo-agent")))
    ds["spec"]["template"]["spec"]["hostPid"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_rbac_grants_exactly_the_publishers_verbs_and_the_enforcements_with_its_component() -> None:
    assert granted(OBJECTS) == PUBLISHER_VERBS
    assert granted(ENFORCING) == PUBLISHER_VERBS | ENFORCEMENT_VERBS
    assert not [o for o in OBJECTS if o["kind"] in ("Role", "RoleBinding")]
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
    assert cfg.kubernetes.enabled and cfg.apply.cgroup_prefixes == () and not cfg.kubernetes.enforce
    assert cfg.listen.socket.startswith(mounts["run"]) and cfg.state_dir == mounts["state"]
    assert cfg.kubernetes.pod_resources_socket.startswith(mounts["pod-resources"] + "/")
    _, port = parse_host_port(cfg.health.listen)
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    notes = ds["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_enforce_component_adds_the_runtime_socket_the_hosts_view_and_enforce_alone() -> None:
    base_pod = one("DaemonSet", "memtopo-agent")["spec"]["template"]["spec"]
    pod = one("DaemonSet", "memtopo-agent", ENFORCING)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["hostPID"] is True and c["securityContext"]["privileged"] is True
    # The API server refuses allowPrivilegeEscalation false beside privileged (schema validation does not).
    assert c["securityContext"]["allowPrivilegeEscalation"] is True
    host = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert host["containerd"] == {"path": "/run/containerd", "type": "Directory"}
    assert mounts["containerd"] == {"name": "containerd", "mountPath": "/run/containerd", "readOnly": True}
    # Everything else is the base's: the same mounts, probes, image, command and capabilities.
    assert [m for m in c["volumeMounts"] if m["name"] != "containerd"] == base_pod["containers"][0]["volumeMounts"]
    assert {k: v for k, v in c.items() if k not in ("securityContext", "volumeMounts")} == {
        k: v for k, v in base_pod["containers"][0].items() if k not in ("securityContext", "volumeMounts")}
    cfg = parse_config(one("ConfigMap", "memtopo-agent", ENFORCING)["data"]["agent.toml"], "enforce")
    base_cfg = parse_config(one("ConfigMap", "memtopo-agent")["data"]["agent.toml"], "base")
    assert cfg.kubernetes.enforce and cfg.kubernetes.runtime_endpoint == "unix:///run/containerd/containerd.sock"
    assert cfg.kubernetes.runtime_endpoint.removeprefix("unix://").startswith(mounts["containerd"]["mountPath"] + "/")
    # The component's agent.toml is the base's with enforcement on, nothing else.
    assert cfg == dataclasses.replace(base_cfg, kubernetes=dataclasses.replace(
        base_cfg.kubernetes, enforce=True, runtime_endpoint=cfg.kubernetes.runtime_endpoint))
    assert {k for k in ENFORCING_BY_KIND} - {k for k in BY_KIND} == {
        ("ClusterRole", "", "memtopo-agent-enforce"), ("ClusterRoleBinding", "", "memtopo-agent-enforce")}


def test_the_shipped_config_publishes_without_a_controller(tmp_path: Path) -> None:
    """``kubectl apply -k deploy/kubernetes`` gives the agent the ConfigMap's agent.toml: with it (host
    paths moved under tmp_path, the stand-in API server instead of the in-cluster one, a captured
    root) the agent publishes its NodeResourceTopology with no controller address anywhere."""
    from bench.k8s_standin import StandInApiServer
    from memtopo.agent.daemon import EXIT_OK, Agent
    from memtopo.agent.sdnotify import Notifier
    from tests.fixtures import lab_root

    shipped = parse_config(one("ConfigMap", "memtopo-agent")["data"]["agent.toml"], "configmap")
    assert shipped.controller.address == "" and shipped.kubernetes.enabled

    async def main() -> None:
        server = StandInApiServer()
        server.add_node("cm-node")
        await server.start()
        cfg = dataclasses.replace(
            shipped, node_name="cm-node", root=str(lab_root("dual-socket-cxl")), state_dir=str(tmp_path / "state"),
            listen=dataclasses.replace(shipped.listen, socket=str(tmp_path / "agent.sock"), read_socket=""),
            health=dataclasses.replace(shipped.health, listen=""),
            discovery=dataclasses.replace(shipped.discovery, udev=False),
            kubernetes=dataclasses.replace(shipped.kubernetes, node_name="cm-node", api_server=server.url))
        agent = Agent(cfg, notifier=Notifier(None))
        run = asyncio.create_task(agent.run())
        obj = await server.wait_stored(lambda o: True, 60)
        assert obj["metadata"]["name"] == "cm-node" and obj["zones"]
        assert agent.link is None and agent.ready()[1]["controller_link"] == "not configured"
        agent.request_stop()
        assert await asyncio.wait_for(run, 60) == EXIT_OK
        await server.stop()
    asyncio.run(asyncio.wait_for(main(), 120))


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
    # Every floor memtopo/ links to is a folder of its own: the image needs each (a link to a folder the
    # image lacks installs a package without its code).
    for link in sorted(p for p in (BASE.parents[1] / "memtopo").iterdir() if p.is_symlink()):
        assert f"COPY {link.name} ./{link.name}" in text, link.name
    assert (BASE.parents[1] / "memtopo" / "fleetpage").is_symlink()
    assert "'.[k8s" in text
