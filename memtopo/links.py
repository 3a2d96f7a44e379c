"""What a reader of the message means by "the link between two accelerators": every pair of a switched
fabric (stored once as a group) expanded, then the pairwise links. Beside the schema, for every floor."""

from __future__ import annotations

from collections.abc import Iterator

from memtopo.v1 import topology_pb2 as pb


def pair_links(topo: pb.MemoryTopology) -> Iterator[tuple[str, str, pb.AcceleratorLink]]:
    """Every accelerator pair's link(s) as ``(a, b, link)``, switched fabrics expanded: what a reader
    of the message (the link matrix, the placement policy) means by "the link between a and b".
    Fabric pairs come first, then accelerator_links in order; a pair may appear more than once."""
    for g in topo.accelerator_groups:
        if not g.link_kind:
            continue
        link = pb.AcceleratorLink(kind=g.link_kind, count=g.link_count, bandwidth_mbps=g.bandwidth_mbps,
                                  source=g.source)
        members = list(g.members)
        for x, a in enumerate(members):
            for b in members[x + 1:]:
                yield a, b, link
    for lk in topo.accelerator_links:
        yield lk.a, lk.b, lk


def link_word(link: pb.AcceleratorLink) -> str:
    """How `nvidia-smi topo -m` spells a link: NV# with a count, otherwise the kind itself."""
    return f"{link.kind}{link.count}" if link.kind == "NV" and link.count else link.kind
