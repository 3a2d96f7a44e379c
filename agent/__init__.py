"""The agent: the node daemon (``daemon.py``) with its gRPC services, the front (Unix socket and TLS),
the link to a controller, health and metrics, the background tasks' supervisor, the NodeResourceTopology
publisher and the CPU enforcement through the container runtime. A library: the CLI starts it
(``memtopo serve``); it never imports the controller or the CLI."""
