"""k8s/podfingerprint.py against the podfingerprint package's own compatibility vectors (v001)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from memtopo.k8s import podfingerprint as pfp

# Pods and signs from the package's testdata (compat-tiny-3pods-1ns, compat-small-10pods-3ns).
TINY = [("production", "jaeger-dpgjk"), ("production", "nginx-rt684"), ("production", "envoy-g9m22")]
SMALL = [("analytics", "controller-69dkj"), ("kube-public", "subscriber-tq6v7"),
         ("kube-public", "transformer-hfbng"), ("kube-public", "validator-c6pn5"), ("kube-system", "proxy-wszrd"),
         ("middleware", "processor-jkrl4"), ("network", "gateway-vsll5"), ("network", "importer-kzdfr"),
         ("network", "importer-q5vt9"), ("staging", "prometheus-bwgbn")]


def test_the_package_vectors() -> None:
    assert pfp.sign(TINY) == "pfp0v001607b76a0e9d3aeb4"
    assert pfp.sign(SMALL) == "pfp0v001567144e4a561bb5a"


def test_namespace_and_name_are_not_interchangeable() -> None:
    assert pfp.sign([("a", "b")]) != pfp.sign([("b", "a")])
    assert pfp.sign([("ab", "c")]) != pfp.sign([("a", "bc")])


@given(st.lists(st.tuples(st.text(max_size=20), st.text(max_size=20)), max_size=30), st.randoms())
def test_the_order_never_matters(pods: list[tuple[str, str]], rng: object) -> None:
    shuffled = list(pods)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert pfp.sign(shuffled) == pfp.sign(pods)
    assert pfp.compatible(pfp.sign(pods))


def test_compatibility() -> None:
    assert not pfp.compatible("pfp0v002607b76a0e9d3aeb4") and not pfp.compatible("garbage")
