"""The fleet policies' names, apart from the policies so that a command line can offer them without
loading them."""

from typing import Final

FLEET_POLICIES: Final = ("hccs", "xpu", "place")
