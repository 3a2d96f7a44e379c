"""Applying binding plans to a host: validated, journaled, verified, rolled back.

Entry points: :class:`apply.engine.Engine` (apply / rollback / recover), :mod:`apply.launch`
(``memtopo exec``), :mod:`apply.host` (the system calls and files everything goes through).
"""
