"""The apply engine's defaults that a command line shows, apart from its configuration class so that
``memtopo --help`` loads neither dataclasses nor the engine."""

from typing import Final, Literal

IrqbalancePolicy = Literal["leave", "ban", "stop"]
IRQBALANCE_POLICIES: Final[tuple[IrqbalancePolicy, ...]] = ("leave", "ban", "stop")

DEFAULT_STATE_DIR: Final = "/var/lib/memtopo/apply"
