"""The Kubernetes wing: one home for Kubernetes facts and clients, on the ground floor only.

Quantities and resource names (``quantity``, ``resources``), object names (``names``), the one API
client and its informer (``kubeapi``, ``informer``), the NodeResourceTopology object both ways (``nrt``
builds it, ``nrt_read`` reads any publisher's), the kubelet's configuration and its PodResources API
(``kubelet``, ``podresources``), the pods fingerprint, the container runtime's CRI client (``cri``), the one
bounded reader of a JSON object written into an annotation or a runtime's answer (``jsonvalue``), and
pure decisions: what the kubelet admits (``admission``), scheduler-plugins' scores (``scoring``), the
static CPU manager's choice (``cpumanager``) and the node's enforcement (``enforcement``). The publisher
and the enforcement loop that use them live in the agent; the extender in its own room.
"""
