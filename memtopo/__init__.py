"""memtopo: the node agent's one import name.

This package is the ground floor — the wire schema (``memtopo.v1``) and what every floor above
shares. The floors (``discovery``, ``planner``, ``apply``, ``agent``, ``controller``, ``cli``) are
top-level folders of the source tree, installed beneath this name.
"""

__version__ = "0.1.0"
