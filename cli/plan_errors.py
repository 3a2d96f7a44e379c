"""What ``memtopo plan``'s runners raise besides the policies' PlanError; ``plan.answer`` turns each into
its error document. Apart from ``plan`` so that the runners (``plan_run``) need not import it."""

from __future__ import annotations


class UsageError(Exception):
    """A combination of options the command cannot act on (e.g. ``--emit plan`` without ``--pid``)."""


class InvalidRootError(Exception):
    """``--root`` names something that is not a readable captured root."""
