"""The reference controller: the fleet's latest topology per node (``fleet.py``), the gRPC Controller
and ControllerAdmin services (``server.py``: Place on ``planner.fleet``, plans relayed to agents). A
library: never imports the agent, apply, the extender or the CLI."""
