"""The shipped deployment schedules: ``kubectl apply -k deploy/scheduling`` (the base in deploy/kubernetes
with its scheduler-extender component) gives the agents publishing NodeResourceTopologies, the extender
as a Deployment of two replicas reading the API server with exactly the permissions it uses, a
NetworkPolicy letting only kube-scheduler reach its port, and the kube-scheduler configuration that sends
every pod to it. Built with tests/test_k8s_manifests.py's builder (and with `kubectl kustomize` where
kubectl is installed), every object validated strictly (kubernetes-validate); the extender's command is
parsed by memtopo's own command line, so a flag it does not take fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from memtopo.cli.main import build_parser
from memtopo.extender.wire import PREFIX, VERBS
from memtopo.k8s.kubeapi import NRT_GROUP, NRT_RESOURCE
from tests.kustomize import K8S_VERSION, build

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPONENT = DEPLOY / "kubernetes" / "scheduler-extender"
SCHEDULING = DEPLOY / "scheduling"
OBJECTS = build(SCHEDULING)
EXTENDER = "memtopo-scheduler-extender"


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def one(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_the_scheduling_kustomization_builds_the_base_and_the_extender() -> None:
    assert sorted(key(o) for o in OBJECTS) == sorted([
        ("Namespace", "", "memtopo"),
        ("CustomResourceDefinition", "", f"{NRT_RESOURCE}.{NRT_GROUP}"),
        ("ServiceAccount", "memtopo", "memtopo-agent"), ("ClusterRole", "", "memtopo-agent"),
        ("ClusterRoleBinding", "", "memtopo-agent"), ("ConfigMap", "memtopo", "memtopo-agent"),
        ("DaemonSet", "memtopo", "memtopo-agent"),
        ("ServiceAccount", "memtopo", "memtopo-controller"), ("Deployment", "memtopo", "memtopo-controller"),
        ("Service", "memtopo", "memtopo-controller"),
        ("ServiceAccount", "memtopo", EXTENDER), ("ClusterRole", "", EXTENDER), ("ClusterRoleBinding", "", EXTENDER),
        ("Deployment", "memtopo", EXTENDER), ("Service", "memtopo", EXTENDER),
        ("PodDisruptionBudget", "memtopo", EXTENDER), ("NetworkPolicy", "memtopo", EXTENDER)])


@pytest.mark.parametrize("obj", OBJECTS, ids=["/".join(key(o)) for o in OBJECTS])
def test_every_object_validates_strictly(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _command() -> list[str]:
    (c,) = one("Deployment", EXTENDER)["spec"]["template"]["spec"]["containers"]
    command: list[str] = c["command"]
    return command


def test_the_extender_runs_two_replicas_of_the_nrt_fleet_behind_client_certificates() -> None:
    dep = one("Deployment", EXTENDER)
    spec = dep["spec"]
    assert spec["replicas"] == 2 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    command = _command()
    assert command[:3] == ["memtopo", "controller", "serve"]
    args = build_parser().parse_args(command[1:])
    assert args.fleet == "nrt" and args.kube_api == "in-cluster" and args.score == "memtopo"
    # HTTPS with a client CA: no verb answers without kube-scheduler's certificate; gRPC stays on loopback.
    assert args.http_tls_cert and args.http_tls_key and args.extender_client_ca
    assert args.listen.startswith("127.0.0.1:")
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    for path in (args.http_tls_cert, args.http_tls_key, args.extender_client_ca):
        assert str(Path(path).parent) in mounted
    assert pod["serviceAccountName"] == EXTENDER and pod["automountServiceAccountToken"] is True
    port = int(args.http.rsplit(":", 1)[1])
    assert c["ports"] == [{"name": "https", "containerPort": port, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    svc = one("Service", EXTENDER)
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    assert svc["spec"]["ports"] == [{"name": "https", "port": port, "targetPort": "https", "protocol": "TCP"}]
    assert one("PodDisruptionBudget", EXTENDER)["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_rbac_grants_exactly_what_the_extender_uses() -> None:
    rules = one("ClusterRole", EXTENDER)["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(NRT_GROUP, NRT_RESOURCE, "get"), (NRT_GROUP, NRT_RESOURCE, "list"),
                       (NRT_GROUP, NRT_RESOURCE, "watch"), ("", "pods", "get"), ("", "pods", "list"),
                       ("", "pods", "watch"), ("", "pods", "patch"), ("", "pods/binding", "create")}
    assert one("ClusterRoleBinding", EXTENDER)["subjects"] == [
        {"kind": "ServiceAccount", "name": EXTENDER, "namespace": "memtopo"}]


def test_the_network_policy_admits_only_kube_scheduler_to_the_port() -> None:
    policy = one("NetworkPolicy", EXTENDER)["spec"]
    assert policy["podSelector"]["matchLabels"] == one("Deployment", EXTENDER)["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 9471, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["podSelector"] == {"matchLabels": {"component": "kube-scheduler"}}
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}


def test_the_agents_publish_with_no_controller_address() -> None:
    from memtopo.agent.config import parse_config

    cfg = parse_config(one("ConfigMap", "memtopo-agent")["data"]["agent.toml"], "configmap")
    assert cfg.kubernetes.enabled and cfg.controller.address == ""


def test_the_scheduler_configuration_sends_every_pod_to_what_the_extender_serves() -> None:
    text = (COMPONENT / "kube-scheduler-config.yaml").read_text()
    config = yaml.safe_load(text)
    (ext,) = config["extenders"]
    port = one("Service", EXTENDER)["spec"]["ports"][0]["port"]
    assert re.fullmatch(rf"https://{EXTENDER}\.memtopo\.svc:{port}{PREFIX.rstrip('/')}", ext["urlPrefix"])
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == VERBS
    assert ext["nodeCacheCapable"] is True and ext["enableHTTPS"] is True
    # Every pod, CPU- and memory-only ones included; kube-scheduler waits for the extender (the choice
    # and its price are written beside it).
    assert "managedResources" not in ext
    assert ext["ignorable"] is False and "ignorable: false —" in text
    # The client certificate the extender requires.
    assert set(ext["tlsConfig"]) == {"caFile", "certFile", "keyFile"}
    # The name kube-scheduler uses is one the extender's listener accepts in Host (--http-host).
    host = ext["urlPrefix"].split("://", 1)[1].split(":", 1)[0]
    command = _command()
    assert host in [command[i + 1] for i, flag in enumerate(command[:-1]) if flag == "--http-host"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
def test_kubectl_kustomize_builds_the_same_objects(tmp_path: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(SCHEDULING)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    built = {key(o): o for o in yaml.safe_load_all(out) if o}
    assert built == {key(o): o for o in OBJECTS}
