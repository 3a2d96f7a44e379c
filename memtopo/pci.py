"""PCI addresses as the kernel and the vendor tools write them: parsing, ordering, one spelling."""

from __future__ import annotations

_HEX = frozenset("0123456789abcdef")


def parse_bdf(name: str) -> tuple[int, int, int, int] | None:
    """``DDDD:BB:DD.F`` (domain may be wider than 4 digits, as Intel VMD's 10000) → numbers, or None."""
    dom, _, rest = name.partition(":")
    bus, _, devfn = rest.partition(":")
    dev, dot, fn = devfn.partition(".")
    if (len(dom) < 4 or len(bus) != 2 or len(dev) != 2 or not dot or len(fn) != 1 or fn > "7" or fn < "0"
            or not _HEX.issuperset(dom) or not _HEX.issuperset(bus) or not _HEX.issuperset(dev)):
        return None
    return int(dom, 16), int(bus, 16), int(dev, 16), int(fn)


def is_bdf(name: str) -> bool:
    return parse_bdf(name) is not None


def bdf_sort_key(bdf: str) -> tuple[int, ...]:
    """Numeric PCI order; anything that is not a BDF sorts last."""
    return parse_bdf(bdf) or (1 << 32,)


def normalize_bdf(text: str) -> str | None:
    """A BDF as vendor tools print it → the kernel's spelling; None if it is not one.

    ``00000000:C1:00.0`` (NVML, xpu-smi), ``0000:C1:00.0`` (npu-smi) and the domain-less
    ``C1:00.0`` all become ``0000:c1:00.0``; wider domains (VMD's ``10000``) keep their digits.
    """
    t = text.strip().strip("\0").lower()
    if t.count(":") == 1:
        t = "0000:" + t
    parsed = parse_bdf(t)
    if parsed is None:
        return None
    dom, bus, dev, fn = parsed
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{fn}"
