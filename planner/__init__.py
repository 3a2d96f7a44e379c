"""Placement policies: pure functions from topology facts and a request to a decision.

Nothing in this package touches the host. Each policy module has the same shape:
``parse_request(obj) -> Request`` (raises PlanError), ``decide(request) -> Decision`` and
``Decision.to_json() -> dict``.
"""
