"""The controller's defaults and limits, apart from the server so that a command line can show them
without loading grpc."""

from typing import Final

from memtopo.grpcserve import MAX_MESSAGE_BYTES

__all__ = ["DEFAULT_HTTP", "DEFAULT_LISTEN", "DEFAULT_PLAN_TIMEOUT_S", "MAX_MESSAGE_BYTES", "MAX_PLAN_TIMEOUT_S"]

DEFAULT_LISTEN: Final = "127.0.0.1:9470"
# The HTTP listener: /healthz, /metrics, the scheduler extender and the fleet page.
DEFAULT_HTTP: Final = "127.0.0.1:9471"
DEFAULT_PLAN_TIMEOUT_S: Final = 30
MAX_PLAN_TIMEOUT_S: Final = 3600
