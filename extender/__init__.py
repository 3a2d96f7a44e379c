"""The scheduler extender: kube-scheduler's ``filter``, ``prioritize`` and ``bind`` verbs over a fleet.

Two fleets, one set of verbs (``service.Extender``): the topologies agents stream to the controller
(``agents.py``, decided by ``planner.fleet``), or the NodeResourceTopology objects and pods of the API
server (``nrt.py``: what the kubelet will admit, ``k8s.admission``, then memtopo's choice among the
placements it accepts, ``planner.zones``). The verbs are plain async functions over JSON; the command
that runs the extender puts them on an HTTP listener (``cli/extender.py``). This floor stands on the
planner and the Kubernetes wing, never on the controller: what it needs of the controller's fleet is
the small ``agents.AgentFleet`` protocol.
"""
