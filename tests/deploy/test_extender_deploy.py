"""deploy/kubernetes/scheduler-extender: the kube-scheduler configuration names the routes and port the
controller serves, and the component builds on the base in deploy/kubernetes with `kubectl kustomize`
(where kubectl and the base are present) into a controller that serves the extender."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memtopo.controller.defaults import DEFAULT_HTTP
from memtopo.controller.extender import PREFIX, VERBS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
COMPONENT = DEPLOY / "scheduler-extender"


def test_the_scheduler_configuration_names_what_the_controller_serves() -> None:
    text = (COMPONENT / "kube-scheduler-config.yaml").read_text()
    port = DEFAULT_HTTP.rsplit(":", 1)[1]
    found = re.search(rf"urlPrefix: https://([\w.-]+):{port}{PREFIX.rstrip('/')}\n", text)
    assert found
    # The name kube-scheduler uses is one the controller's listener accepts in Host (--http-host).
    command = (COMPONENT / "controller-http.yaml").read_text()
    assert f'"--http-host", "{found.group(1)}"' in command
    for key, verb in zip(("filterVerb", "prioritizeVerb", "bindVerb"), VERBS, strict=True):
        assert f"{key}: {verb}\n" in text
    assert "nodeCacheCapable: true" in text
    for resource in ("huawei.com/Ascend910", "kunlunxin.com/xpu", "nvidia.com/gpu", "amd.com/gpu"):
        assert f"- name: {resource}\n    ignoredByScheduler: false" in text


@pytest.mark.skipif(shutil.which("kubectl") is None or not (DEPLOY / "kustomization.yaml").exists(),
                    reason="needs kubectl and the base in deploy/kubernetes")
def test_the_component_builds_on_the_base(tmp_path: Path) -> None:
    # kustomize takes relative roots only: the base and an operator's kustomization side by side.
    shutil.copytree(DEPLOY, tmp_path / "base")
    use = tmp_path / "use"
    use.mkdir()
    (use / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n- ../base\ncomponents:\n- ../base/scheduler-extender\n")
    out = subprocess.run(["kubectl", "kustomize", str(use)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    deployment = out[out.index("kind: Deployment\nmetadata:\n  labels:\n    app.kubernetes.io/component: controller"):]
    deployment = deployment[:deployment.index("\n---")]
    assert "- --http\n        - 0.0.0.0:9471" in deployment and "- --kube-api\n        - in-cluster" in deployment
    assert "automountServiceAccountToken: true" in deployment
    probe = deployment[deployment.index("readinessProbe:"):deployment.index("resources:")]
    assert "httpGet:" in probe and "tcpSocket" not in probe
    assert "name: memtopo-scheduler-extender" in out and "pods/binding" in out
    assert re.search(r"- name: http\n\s+port: 9471", out)
