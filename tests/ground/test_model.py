"""memtopo.model: classes made without generated code behave as @dataclass makes them."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.discovery import accelerators, assemble, parts
from memtopo.model import frozen, mutable


@dataclass(frozen=True)
class RefFrozen:
    a: int
    b: tuple[int, ...] = ()
    c: Mapping[str, str] = field(default_factory=dict)
    d: str = field(default="x", compare=False)


@frozen
class OurFrozen:
    a: int
    b: tuple[int, ...] = ()
    c: Mapping[str, str] = field(default_factory=dict)
    d: str = field(default="x", compare=False)


@dataclass
class RefMutable:
    a: int
    b: list[int] = field(default_factory=list)


@mutable
class OurMutable:
    a: int
    b: list[int] = field(default_factory=list)


@frozen
class Single:
    a: int


@dataclass(frozen=True)
class SingleRef:
    a: int


@dataclass(frozen=True)
class Derived(OurFrozen):
    e: int = 0


def _shape(obj: object) -> str:
    """repr with the class name taken off, to compare a twin with its reference."""
    r = repr(obj)
    return r[r.index("("):]


values = st.tuples(st.integers(), st.lists(st.integers(), max_size=3).map(tuple), st.text(max_size=5))


@settings(deadline=None)
@given(values, values)
def test_frozen_matches_dataclass(x: tuple[int, tuple[int, ...], str], y: tuple[int, tuple[int, ...], str]) -> None:
    ref_x, ref_y = RefFrozen(x[0], x[1], d=x[2]), RefFrozen(x[0], b=y[1], d=y[2])
    our_x, our_y = OurFrozen(x[0], x[1], d=x[2]), OurFrozen(x[0], b=y[1], d=y[2])
    assert _shape(our_x) == _shape(ref_x)
    assert (our_x == our_y) == (ref_x == ref_y)
    assert dataclasses.asdict(our_x) == dataclasses.asdict(ref_x)
    assert _shape(dataclasses.replace(our_x, a=y[0])) == _shape(dataclasses.replace(ref_x, a=y[0]))
    assert [f.name for f in dataclasses.fields(our_x)] == [f.name for f in dataclasses.fields(ref_x)]
    ours, ref = Single(x[0]), SingleRef(x[0])
    # The same hash as @dataclass: sets of parts iterate in the same order.
    assert hash(ours) == hash(ref)


def test_frozen_refuses_what_dataclass_refuses() -> None:
    obj = OurFrozen(1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'a'"):
        obj.a = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'a'"):
        del obj.a
    bad: list[Callable[[], object]] = [
        lambda: OurFrozen(),  # type: ignore[call-arg]
        lambda: OurFrozen(1, a=2),  # type: ignore[misc]
        lambda: OurFrozen(1, z=2),  # type: ignore[call-arg]
        lambda: OurFrozen(1, (), {}, "d", 5),  # type: ignore[call-arg]
    ]
    for make in bad:
        with pytest.raises(TypeError):
            make()
    assert dataclasses.is_dataclass(obj)
    assert OurFrozen.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert OurFrozen.__match_args__ == RefFrozen.__match_args__


def test_defaults_are_fresh_and_copies_equal() -> None:
    one, two = OurFrozen(1), OurFrozen(1)
    assert one.c == {} and one.c is not two.c
    assert copy.deepcopy(one) == one
    assert pickle.loads(pickle.dumps(parts.KernelTier(1, (0, 1)))) == parts.KernelTier(1, (0, 1))


def test_mutable_matches_dataclass() -> None:
    ours, ref = OurMutable(1), RefMutable(1)
    ours.b.append(3)
    ref.b.append(3)
    ours.a = ref.a = 5
    assert _shape(ours) == _shape(ref)
    assert ours == OurMutable(5, [3]) and ours != OurMutable(5)
    with pytest.raises(TypeError):
        hash(ours)


def test_a_dataclass_may_derive_from_a_model() -> None:
    d = Derived(1, e=4)
    assert (d.a, d.e) == (1, 4)
    assert d == Derived(1, e=4) and d != Derived(1, e=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.e = 2  # type: ignore[misc]


def _models() -> list[type[Any]]:
    found: list[type[Any]] = []
    for module in (parts, accelerators, assemble):
        found += [v for v in vars(module).values()
                  if isinstance(v, type) and v.__module__ == module.__name__ and dataclasses.is_dataclass(v)]
    return found


def test_discovery_models_share_their_methods() -> None:
    """No model class compiled methods of its own (what made importing discovery slow)."""
    models = _models()
    assert len(models) >= 30
    first = models[0]
    for cls in models:
        for name in ("__init__", "__repr__", "__eq__"):
            assert getattr(cls, name).__code__ is getattr(first, name).__code__, (cls, name)
