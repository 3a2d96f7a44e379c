"""memtopo: the node agent's one import name.

This package is the ground floor: the wire schema (``memtopo.v1``) and what every floor above shares,
in two kinds of module: pure value code (``cpulist``, ``text``, ``protojson``, ``model`` …) and host
reading, always through a root (``hostfs``, ``runner``, ``mounts``, ``hostinfo`` …);
``tests/test_layering.py`` holds which is which. The floors (``discovery``, ``planner``, ``apply``,
``draw``, ``k8s``, ``agent``, ``controller``, ``extender``, ``cli``) are top-level folders of the
source tree, installed beneath this name through the links ``memtopo/<floor>``.
"""

__version__ = "0.1.0"
