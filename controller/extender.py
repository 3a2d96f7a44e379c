"""kube-scheduler extender verbs (filled in below)."""

from __future__ import annotations

from controller.http import Routes
from controller.state import ControllerState


def install(routes: Routes, state: ControllerState) -> None:
    """Register /scheduler/filter, /scheduler/prioritize and /scheduler/bind."""
