"""What the controller knows about its fleet, and the link protocol's decisions. Pure: no gRPC, no I/O.

One ``Fleet`` lives on the controller's event loop. Every agent link is a *session* (an integer the
fleet hands out on hello); messages from a session that is no longer its node's current one are
ignored, so a replaced or dead stream can never overwrite what a newer stream said. The methods
return what to send back (``Ack`` / ``RequestSnapshot`` / nothing) and the server only carries it.

Bounds: one record per node name (``max_nodes`` of them), one topology per node, the last
``results_per_node`` plan results per node, and at most one outstanding snapshot request per link.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

RESULTS_PER_NODE = 256
MAX_NODES = 100_000
# A DNS name is at most 253 characters; node names are host names (or what the config says).
MAX_NAME = 253
MAX_ID = 256

P = planpb.PlanResult


class ProtocolError(ValueError):
    """An agent message the link protocol refuses (the server answers INVALID_ARGUMENT)."""


class FleetFullError(ProtocolError):
    """A new node name beyond ``max_nodes`` (the server answers RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class Hello:
    """The identifying part of ``AgentHello``."""

    node_name: str
    agent_instance_id: str
    boot_id: str = ""
    generation: int = 0
    fingerprint: str = ""
    agent_version: str = ""


@dataclass(frozen=True)
class Ack:
    """The controller holds this generation/fingerprint of the node's topology."""

    generation: int
    fingerprint: str


@dataclass(frozen=True)
class RequestSnapshot:
    reason: str


Reply = Ack | RequestSnapshot


@dataclass(frozen=True)
class Connected:
    session: int
    reply: Reply
    # The node's previous live session, which the server must end.
    replaced: int | None
    replaced_peer: str = ""


@dataclass(frozen=True)
class SnapshotOutcome:
    stored: bool
    reply: Ack | None
    # Why a snapshot was not stored (empty when stored).
    reason: str = ""


@dataclass(frozen=True)
class NodeInfo:
    """One row of ListNodes. ``generation``/``fingerprint`` are the held snapshot's (0/"" if none);
    ``last_seen`` is the time of the node's last message, or of its disconnect; ``updated`` when the
    held snapshot was stored (0 if none) (Unix seconds)."""

    node_name: str
    agent_instance_id: str
    boot_id: str
    agent_version: str
    generation: int
    fingerprint: str
    connected: bool
    last_seen: float
    peer: str
    numa_nodes: int
    accelerators: int
    updated: float = 0.0


@dataclass(frozen=True)
class _Held:
    """A stored snapshot, kept serialized: a parsed MemoryTopology costs several times its wire size
    in memory (about 60 KiB against 11 KiB for a 2-node host), and it is read back rarely."""

    payload: bytes
    instance_id: str
    generation: int
    fingerprint: str
    numa_nodes: int
    accelerators: int
    stored_at: float

    @classmethod
    def of(cls, topology: pb.MemoryTopology, instance_id: str, now: float, payload: bytes | None = None) -> _Held:
        return cls(topology.SerializeToString() if payload is None else payload, instance_id, topology.generation,
                   topology.fingerprint, len(topology.numa_nodes), len(topology.accelerators), now)


@dataclass
class _Node:
    name: str
    instance_id: str = ""
    boot_id: str = ""
    agent_version: str = ""
    peer: str = ""
    session: int = 0  # 0 = not connected
    last_seen: float = 0.0
    held: _Held | None = None
    request_outstanding: bool = False
    # plan_id → (state, serialized PlanResult); serialized for the same reason as _Held.
    results: OrderedDict[str, tuple[int, bytes]] = field(default_factory=OrderedDict)


def _check_text(what: str, value: str, limit: int, *, required: bool) -> None:
    if required and not value:
        raise ProtocolError(f"hello without {what}")
    if len(value) > limit:
        raise ProtocolError(f"hello {what} is longer than {limit} characters")
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise ProtocolError(f"hello {what} contains control characters")


def _stale_reason(held: _Held | None, instance_id: str, generation: int, fingerprint: str) -> str | None:
    """None when the held snapshot is exactly what the agent has, else why a snapshot is needed."""
    if held is None:
        return "no snapshot held"
    if held.instance_id != instance_id:
        return "new agent instance"
    have = held.generation
    if have < generation:
        return f"stale generation {have} < {generation}"
    if have > generation:
        return f"agent generation {generation} is behind the held {have}"
    if held.fingerprint != fingerprint:
        return f"fingerprint differs at generation {have}"
    return None


class Fleet:
    """Latest topology, link state and plan results per node. Not thread-safe: one event loop."""

    def __init__(self, *, results_per_node: int = RESULTS_PER_NODE, max_nodes: int = MAX_NODES,
                 clock: Callable[[], float] = time.time) -> None:
        self._nodes: dict[str, _Node] = {}
        self._sessions: dict[int, _Node] = {}
        self._ids = itertools.count(1)
        self._results_per_node = results_per_node
        self._max_nodes = max_nodes
        self._clock = clock

    # ---- link events ----------------------------------------------------------------------------
    def connect(self, hello: Hello, peer: str) -> Connected:
        """A new link said hello: it becomes the node's current session (ending any previous one)."""
        _check_text("node_name", hello.node_name, MAX_NAME, required=True)
        _check_text("agent_instance_id", hello.agent_instance_id, MAX_ID, required=True)
        _check_text("boot_id", hello.boot_id, MAX_ID, required=False)
        _check_text("agent_version", hello.agent_version, MAX_ID, required=False)
        node = self._nodes.get(hello.node_name)
        if node is None:
            if len(self._nodes) >= self._max_nodes:
                raise FleetFullError(f"the controller already tracks {self._max_nodes} nodes")
            node = self._nodes[hello.node_name] = _Node(hello.node_name)
        replaced = node.session or None
        replaced_peer = node.peer if replaced else ""
        if replaced:
            del self._sessions[replaced]
        session = next(self._ids)
        self._sessions[session] = node
        node.session = session
        node.peer = peer
        node.instance_id = hello.agent_instance_id
        node.boot_id = hello.boot_id
        node.agent_version = hello.agent_version
        node.last_seen = self._clock()
        reason = ("unknown node" if node.held is None else
                  _stale_reason(node.held, hello.agent_instance_id, hello.generation, hello.fingerprint))
        reply: Reply
        if reason is None:
            node.request_outstanding = False
            reply = self._ack(node)
        else:
            node.request_outstanding = True
            reply = RequestSnapshot(reason)
        return Connected(session, reply, replaced, replaced_peer)

    def snapshot(self, session: int, topology: pb.MemoryTopology, payload: bytes | None = None) -> SnapshotOutcome:
        """Store a full snapshot unless it is older than what this agent instance already sent.
        ``payload``: ``topology``'s bytes as they arrived, kept as they are (else it is serialized)."""
        node = self._sessions.get(session)
        if node is None:
            return SnapshotOutcome(False, None, "link superseded")
        now = node.last_seen = self._clock()
        held = node.held
        if (held is not None and held.instance_id == node.instance_id
                and topology.generation < held.generation):
            # Stale in-flight message; the agent's later messages carry the newer generation.
            return SnapshotOutcome(False, None,
                                   f"generation {topology.generation} is older than the held {held.generation}")
        node.held = _Held.of(topology, node.instance_id, now, payload)
        node.request_outstanding = False
        return SnapshotOutcome(True, self._ack(node))

    def heartbeat(self, session: int, generation: int, fingerprint: str) -> RequestSnapshot | None:
        """A snapshot request when the agent has something the controller lacks (at most one
        outstanding per link: the agent answers each request with a full snapshot)."""
        node = self._sessions.get(session)
        if node is None:
            return None
        node.last_seen = self._clock()
        reason = _stale_reason(node.held, node.instance_id, generation, fingerprint)
        if reason is None or node.request_outstanding:
            return None
        node.request_outstanding = True
        return RequestSnapshot(reason)

    def record_result(self, session: int, result: planpb.PlanResult) -> str | None:
        """Keep a plan result (stamped with the node name); returns the node name, None if ignored."""
        node = self._sessions.get(session)
        if node is None or not result.plan_id:
            return None
        node.last_seen = self._clock()
        if not result.node_name:
            result.node_name = node.name
        results = node.results
        old = results.get(result.plan_id)
        # The engine does not store dry runs; a later dry run of an applied id must not hide it here.
        if old is not None and result.state == P.STATE_DRY_RUN and old[0] != P.STATE_DRY_RUN:
            return node.name
        results[result.plan_id] = (result.state, result.SerializeToString())
        results.move_to_end(result.plan_id)
        while len(results) > self._results_per_node:
            results.popitem(last=False)
        return node.name

    def disconnect(self, session: int) -> str | None:
        """The link ended; the node is kept. Returns its name if this was its current session."""
        node = self._sessions.pop(session, None)
        if node is None:
            return None
        node.session = 0
        node.request_outstanding = False
        node.last_seen = self._clock()
        return node.name

    # ---- queries --------------------------------------------------------------------------------
    def node_of(self, session: int) -> str | None:
        node = self._sessions.get(session)
        return node.name if node else None

    def session_of(self, node_name: str) -> int | None:
        node = self._nodes.get(node_name)
        return node.session if node and node.session else None

    def knows(self, node_name: str) -> bool:
        return node_name in self._nodes

    def topology(self, node_name: str) -> pb.MemoryTopology | None:
        """The node's latest snapshot (a fresh message: the caller may change it)."""
        payload = self.topology_bytes(node_name)
        return pb.MemoryTopology.FromString(payload) if payload is not None else None

    def held(self, node_name: str) -> tuple[bool, bytes | None] | None:
        """(connected, the held snapshot's bytes or None) without building a NodeInfo; None if unknown.
        The bytes object stays the same until the node stores a new snapshot (callers may cache by it)."""
        node = self._nodes.get(node_name)
        if node is None:
            return None
        return node.session != 0, node.held.payload if node.held else None

    def held_many(self, names: Iterable[str]) -> tuple[list[tuple[str, bool, bytes | None]], list[str]]:
        """``held`` for many names at once: ([(name, connected, bytes or None)], [unknown names])."""
        nodes = self._nodes
        out: list[tuple[str, bool, bytes | None]] = []
        unknown: list[str] = []
        for name in names:
            node = nodes.get(name)
            if node is None:
                unknown.append(name)
            else:
                held = node.held
                out.append((name, node.session != 0, held.payload if held is not None else None))
        return out, unknown

    def topology_bytes(self, node_name: str) -> bytes | None:
        node = self._nodes.get(node_name)
        return node.held.payload if node and node.held else None

    def result(self, node_name: str, plan_id: str) -> planpb.PlanResult | None:
        node = self._nodes.get(node_name)
        stored = node.results.get(plan_id) if node else None
        return planpb.PlanResult.FromString(stored[1]) if stored else None

    def results(self, node_name: str, limit: int) -> list[planpb.PlanResult]:
        """The node's last ``limit`` plan results, newest first (by arrival)."""
        node = self._nodes.get(node_name)
        if node is None or limit <= 0:
            return []
        return [planpb.PlanResult.FromString(payload)
                for _, payload in itertools.islice(reversed(node.results.values()), limit)]

    def info(self, node_name: str) -> NodeInfo | None:
        node = self._nodes.get(node_name)
        return self._info(node) if node is not None else None

    def nodes(self) -> list[NodeInfo]:
        return [self._info(self._nodes[name]) for name in sorted(self._nodes)]

    def held_count(self) -> int:
        """Nodes with a stored topology."""
        return sum(1 for n in self._nodes.values() if n.held is not None)

    def __len__(self) -> int:
        return len(self._nodes)

    # ---- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _ack(node: _Node) -> Ack:
        assert node.held is not None
        return Ack(node.held.generation, node.held.fingerprint)

    @staticmethod
    def _info(node: _Node) -> NodeInfo:
        held = node.held
        return NodeInfo(
            node_name=node.name, agent_instance_id=node.instance_id, boot_id=node.boot_id,
            agent_version=node.agent_version,
            generation=held.generation if held else 0, fingerprint=held.fingerprint if held else "",
            connected=node.session != 0, last_seen=node.last_seen, peer=node.peer,
            numa_nodes=held.numa_nodes if held else 0, accelerators=held.accelerators if held else 0,
            updated=held.stored_at if held else 0.0)
