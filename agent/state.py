"""The agent's published topology: one immutable snapshot per generation, serialized once.

Discovery produces a fresh MemoryTopology on every rescan; most rescans find nothing new. A new
generation is published only when the content fingerprint changes, and its wire bytes are made
once here so that GetTopology, every watcher and the controller link send the same bytes without
re-serializing (the RPC benchmark measures exactly this).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import topology_pb2 as pb
from memtopo.wire import embed

SNAPSHOT_FIELD = apb.TopologyEvent.DESCRIPTOR.fields_by_name["snapshot"].number


def new_instance_id() -> str:
    """Unique per agent process: a restart gives a new one, so clients know generations restarted."""
    return f"{os.getpid()}-{time.time_ns() // 1_000_000:x}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Published:
    """One generation as it goes on the wire. ``topology`` must not be mutated by readers."""

    topology: pb.MemoryTopology
    payload: bytes
    generation: int
    fingerprint: str

    def event_bytes(self, instance_id: str, *, snapshot: bool = True, kind: str = "") -> bytes:
        """A serialized TopologyEvent: protobuf messages concatenate, so the snapshot's cached bytes
        are appended to a small header instead of being encoded again."""
        head = apb.TopologyEvent(agent_instance_id=instance_id, generation=self.generation,
                                 fingerprint=self.fingerprint, sent=now())
        if kind == "unchanged":
            head.unchanged.SetInParent()
        elif kind == "heartbeat":
            head.heartbeat.SetInParent()
        elif kind:
            head.closing.reason = kind
        data = head.SerializeToString()
        return embed(data, SNAPSHOT_FIELD, self.payload) if snapshot and not kind else data


def now() -> Timestamp:
    """The send time stamped on every event and link message."""
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


class TopologyState:
    """Latest published generation plus change notification; lives on the event loop thread."""

    def __init__(self, instance_id: str | None = None) -> None:
        self.instance_id = instance_id or new_instance_id()
        self.current: Published | None = None
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[Published], None]] = []
        self.closing = False
        # Discoveries that found the published topology again (SIGHUP, uevent, periodic): watchers
        # are told, so a rescan is visible even when it changes nothing.
        self.rescans = 0

    @property
    def generation(self) -> int:
        return self.current.generation if self.current else 0

    def add_listener(self, callback: Callable[[Published], None]) -> None:
        self._listeners.append(callback)

    def publish(self, topo: pb.MemoryTopology, payload: bytes | None = None) -> Published | None:
        """Publish ``topo`` as the next generation if its fingerprint differs; None when unchanged.

        ``payload``: ``topo`` as serialized where it was made (the discovery child), sent as it is
        when it already carries the next generation. ``topo`` is owned by the state from here on
        (it is served as is to every reader)."""
        if self.current is not None and topo.fingerprint == self.current.fingerprint:
            self.rescans += 1
            self._wake()
            return None
        generation = self.generation + 1
        if payload is None or topo.generation != generation:
            topo.generation = generation
            payload = topo.SerializeToString()
        pub = Published(topo, payload, generation, topo.fingerprint)
        self.current = pub
        self._wake()
        for callback in self._listeners:
            callback(pub)
        return pub

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """Wake every waiter for the last time: the agent is shutting down."""
        self.closing = True
        self._changed.set()

    async def wait_change(self, after_generation: int, timeout: float | None,
                          after_rescans: int | None = None) -> Published | None:
        """The first generation newer than ``after_generation`` (or, given ``after_rescans``, the
        current one once a rescan beyond that count found it again); None on timeout or shutdown."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while not self.closing:
            cur = self.current
            if cur is not None and (cur.generation > after_generation
                                    or (after_rescans is not None and self.rescans > after_rescans)):
                return cur
            event = self._changed
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return None
        return None
