"""Linux cpulist ("0-3,8,10-11") and mask ("ffffffff,00000000") formats, as sysfs prints them."""

from __future__ import annotations

from collections.abc import Iterable

from memtopo.text import excerpt

# Far above any real machine (the kernel's NR_CPUS tops out at 8192); stops "0-4294967295" from
# allocating a list of four billion ints out of a corrupted file.
MAX_ID = 1 << 16
# What a kernel can have: CPU ids below NR_CPUS, whose largest setting on any architecture is 8192
# (x86-64 and powerpc with MAXSMP), and node ids below MAX_NUMNODES = 1 << NODES_SHIFT, at most 10.
KERNEL_MAX_CPUS = 8192
KERNEL_MAX_NODES = 1024


class CpuListError(ValueError):
    """A cpulist or mask string that does not parse."""


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel list (``%*pbl``), including the ``a-b:stride/group`` form. Empty → ().

    Trailing NULs are tolerated: hwloc-gathered trees pad some files with them.
    """
    text = text.strip().rstrip("\0").strip()
    if not text:
        return ()
    ids: set[int] = set()
    for chunk in text.split(","):
        chunk = chunk.strip()
        if not chunk:
            raise CpuListError(f"empty element in {excerpt(text)}")
        rng, _, stride_spec = chunk.partition(":")
        lo_s, dash, hi_s = rng.partition("-")
        lo, hi = _to_id(lo_s, text), _to_id(hi_s, text) if dash else None
        if hi is None:
            if stride_spec:
                raise CpuListError(f"stride without a range in {excerpt(text)}")
            ids.add(lo)
            continue
        if hi < lo:
            raise CpuListError(f"descending range {excerpt(chunk)} in {excerpt(text)}")
        used, group = 1, 1
        if stride_spec:
            used_s, slash, group_s = stride_spec.partition("/")
            if not slash:
                raise CpuListError(f"malformed stride {excerpt(chunk)}")
            used, group = _to_id(used_s, text), _to_id(group_s, text)
            if used == 0 or group == 0 or used > group:
                raise CpuListError(f"malformed stride {excerpt(chunk)}")
        if group == 1:
            ids.update(range(lo, hi + 1))
            continue
        for base in range(lo, hi + 1, group):
            ids.update(range(base, min(base + used, hi + 1)))
    return tuple(sorted(ids))


def _to_id(s: str, whole: str) -> int:
    s = s.strip()
    if not s.isdigit() or not s.isascii():
        raise CpuListError(f"not a number: {excerpt(s)} in {excerpt(whole)}")
    value = int(s)
    if value >= MAX_ID:
        raise CpuListError(f"id {value} out of range in {excerpt(whole)}")
    return value


def _mask_value(text: str) -> int:
    digits = text.strip().rstrip("\0").strip().replace(",", "")
    if digits.startswith(("0x", "0X")):
        digits = digits[2:]
    if not digits:
        return 0
    try:
        value = int(digits, 16)
    except ValueError as exc:
        raise CpuListError(f"not a hex mask: {excerpt(text)}") from exc
    if value.bit_length() > MAX_ID:
        raise CpuListError(f"mask too wide: {len(digits)} hex digits")
    return value


def mask_width(text: str) -> int:
    """One past the highest id a kernel hex mask names (0 for an empty mask)."""
    return _mask_value(text).bit_length()


def parse_mask(text: str) -> tuple[int, ...]:
    """Parse a kernel hex mask (``%*pb``): 32-bit words, most significant first, comma separated."""
    value = _mask_value(text)
    # The set bits from the binary digits, lowest first: one pass in C instead of a shift per bit.
    return tuple(i for i, bit in enumerate(reversed(f"{value:b}")) if bit == "1") if value else ()


def format_cpulist(ids: Iterable[int]) -> str:
    """Format ids as the shortest kernel list: ``[0,1,2,3,8]`` → ``"0-3,8"``."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
