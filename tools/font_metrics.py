"""Writes draw/metrics.py: the advance widths of DejaVu Sans and DejaVu Sans Bold (the first font the
drawing's stylesheet names) for the characters the drawing writes, read from the fonts' own tables.

    .venv/bin/python tools/font_metrics.py [FONT_DIR] > draw/metrics.py

Debian's fonts-dejavu-core has them in /usr/share/fonts/truetype/dejavu. Only `head` (units per em),
`hhea` (how many metrics), `hmtx` (the advances) and `cmap` format 4 (character → glyph) are read.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

CHARS = ("".join(chr(c) for c in range(32, 127)) + "".join(chr(c) for c in range(160, 256))
         + "…·→←⇄↔×–—≤≥µ±°²³¹‰€•″′⁄\ufffd")


def tables(data: bytes) -> dict[str, bytes]:
    count = struct.unpack(">H", data[4:6])[0]
    out = {}
    for i in range(count):
        tag, _, offset, length = struct.unpack(">4sIII", data[12 + 16 * i: 28 + 16 * i])
        out[tag.decode()] = data[offset: offset + length]
    return out


def cmap4(cmap: bytes) -> dict[int, int]:
    n = struct.unpack(">H", cmap[2:4])[0]
    for i in range(n):
        platform, encoding, offset = struct.unpack(">HHI", cmap[4 + 8 * i: 12 + 8 * i])
        if (platform, encoding) in ((3, 1), (0, 3)) and struct.unpack(">H", cmap[offset: offset + 2])[0] == 4:
            sub = cmap[offset:]
            segs = struct.unpack(">H", sub[6:8])[0] // 2
            ends = struct.unpack(f">{segs}H", sub[14: 14 + 2 * segs])
            base = 16 + 2 * segs
            starts = struct.unpack(f">{segs}H", sub[base: base + 2 * segs])
            deltas = struct.unpack(f">{segs}h", sub[base + 2 * segs: base + 4 * segs])
            range_at = base + 4 * segs
            ranges = struct.unpack(f">{segs}H", sub[range_at: range_at + 2 * segs])
            glyphs = {}
            for k in range(segs):
                for code in range(starts[k], ends[k] + 1):
                    if code == 0xFFFF:
                        continue
                    if ranges[k] == 0:
                        glyph = (code + deltas[k]) & 0xFFFF
                    else:
                        where = range_at + 2 * k + ranges[k] + 2 * (code - starts[k])
                        glyph = struct.unpack(">H", sub[where: where + 2])[0]
                        glyph = (glyph + deltas[k]) & 0xFFFF if glyph else 0
                    glyphs[code] = glyph
            return glyphs
    raise SystemExit("no format 4 Unicode cmap")


def advances(path: Path) -> tuple[int, dict[str, int]]:
    t = tables(path.read_bytes())
    per_em = struct.unpack(">H", t["head"][18:20])[0]
    metrics = struct.unpack(">H", t["hhea"][34:36])[0]
    widths = [struct.unpack(">H", t["hmtx"][4 * i: 4 * i + 2])[0] for i in range(metrics)]
    glyphs = cmap4(t["cmap"])
    return per_em, {c: widths[min(glyphs[ord(c)], metrics - 1)] for c in CHARS if ord(c) in glyphs}


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/usr/share/fonts/truetype/dejavu")
    per_em, regular = advances(folder / "DejaVuSans.ttf")
    bold_em, bold = advances(folder / "DejaVuSans-Bold.ttf")
    assert per_em == bold_em
    print('"""Advance widths of DejaVu Sans and DejaVu Sans Bold, in font units (UNITS_PER_EM to the em), for the')
    print("characters the drawing writes. Written by tools/font_metrics.py from the fonts' own tables; the")
    print('drawing sizes every text with them, and tests/draw/test_draw_svg.py checks its boxes with them."""')
    print()
    print("from typing import Final")
    print()
    print(f"UNITS_PER_EM: Final = {per_em}")
    for name, table in (("REGULAR", regular), ("BOLD", bold)):
        print(f"{name}: Final[dict[str, int]] = {{")
        items = [f"{c!r}: {w}" for c, w in table.items()]
        line = "   "
        for item in items:
            if len(line) + len(item) + 2 > 116:
                print(line.rstrip())
                line = "   "
            line += f" {item},"
        print(line.rstrip())
        print("}")


if __name__ == "__main__":
    main()
