"""The controller's defaults and limits, apart from the server so that a command line can show them
without loading grpc."""

from typing import Final

DEFAULT_LISTEN: Final = "127.0.0.1:9470"
# The HTTP listener: /healthz, /metrics, the scheduler extender and the fleet page.
DEFAULT_HTTP: Final = "127.0.0.1:9471"
DEFAULT_PLAN_TIMEOUT_S: Final = 30
MAX_PLAN_TIMEOUT_S: Final = 3600
# A 64-node host's topology is a few hundred KiB; leave room for large accelerator fleets.
MAX_MESSAGE_BYTES: Final = 64 << 20
