"""The fingerprint of a set of pods, as NFD's topology-updater writes it into a NodeResourceTopology
(attribute ``nodeTopologyPodsFingerprint``) and scheduler-plugins' cache checks it.

The algorithm is the ``k8stopologyawareschedwg/podfingerprint`` package's, version ``v001``: each pod is
identified by its namespace and name only; its hash is XXH64(name, seed = XXH64(namespace)); the set's
hashes are sorted, fed as little-endian 64-bit words into one XXH64 seeded with zero, and the sign is
``pfp0`` + ``v001`` + the digest in hex. The same set, in any order, gives the same sign — so the
extender can tell whether a node's object already counts the pods bound to it.

Which pods a publisher counts is its method (attribute ``nodeTopologyPodsFingerprintMethod``): ``all``,
``with-exclusive-resources`` or ``exclude-terminal``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

import xxhash

PREFIX: Final = "pfp0"
VERSION: Final = "v001"
ATTRIBUTE: Final = "nodeTopologyPodsFingerprint"
METHOD_ATTRIBUTE: Final = "nodeTopologyPodsFingerprintMethod"
METHOD_ALL: Final = "all"
METHOD_WITH_EXCLUSIVE_RESOURCES: Final = "with-exclusive-resources"
METHOD_EXCLUDE_TERMINAL: Final = "exclude-terminal"
METHODS: Final = (METHOD_ALL, METHOD_WITH_EXCLUSIVE_RESOURCES, METHOD_EXCLUDE_TERMINAL)
_WORD: Final = struct.Struct("<Q")


def pod_hash(namespace: str, name: str) -> int:
    return xxhash.xxh64_intdigest(name.encode(), seed=xxhash.xxh64_intdigest(namespace.encode()))


def sign(pods: Iterable[tuple[str, str]]) -> str:
    """The fingerprint of the pods given as (namespace, name) pairs; duplicates count as often as given,
    as upstream counts them."""
    digest = xxhash.xxh64()
    for value in sorted(pod_hash(namespace, name) for namespace, name in pods):
        digest.update(_WORD.pack(value))
    return PREFIX + VERSION + digest.hexdigest()


def compatible(fingerprint: str) -> bool:
    """Whether ``fingerprint`` is a sign of this version that :func:`sign` can be compared with."""
    return len(fingerprint) >= 16 and fingerprint.startswith(PREFIX + VERSION)
