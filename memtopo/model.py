"""Dataclasses for value models, without the code generation of ``@dataclass``.

``@dataclass`` writes each class's ``__init__``, ``__repr__``, ``__eq__``, ``__hash__`` and (frozen)
``__setattr__``/``__delattr__`` as source text and compiles it when the class is created: about 1 ms
a class, paid again by every process (the bytecode cache holds the module, not what it generated).
Discovery's model has dozens of classes, so that compiling was a large part of ``memtopo topo``.

``frozen`` and ``mutable`` make the same classes from shared methods instead: they are real
dataclasses (``dataclasses.fields``, ``replace``, ``asdict`` and dataclass subclasses work), with the
same constructor, repr, equality, hash and immutability as ``@dataclass(frozen=True)`` and
``@dataclass``, and type checkers see them as dataclasses (``dataclass_transform``).
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from operator import attrgetter
from typing import Any, dataclass_transform

_osetattr = object.__setattr__


@dataclasses.dataclass(frozen=True)
class _FrozenFlags:
    """Whose ``__dataclass_params__`` a frozen model carries (a dataclass subclass checks them)."""


@dataclasses.dataclass
class _MutableFlags:
    """Whose ``__dataclass_params__`` a mutable model carries."""


def _values_of(names: tuple[str, ...]) -> Callable[[object], tuple[Any, ...]]:
    """A tuple of the named attributes, as the generated ``__eq__``/``__hash__`` compare and hash."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)  # several names: a tuple


def _build[C: type](cls: C, frozen: bool) -> C:
    if cls.__dict__.get("__doc__") is None:
        # @dataclass writes the signature here, which costs an inspect.signature per class.
        cls.__doc__ = cls.__name__
    # Field collection only: no method is generated (and so nothing compiled).
    dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    fields = dataclasses.fields(cls)
    for f in fields:
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__qualname__}.{f.name}: init=False and kw_only fields are not supported here")
    names = tuple(f.name for f in fields)
    count = len(names)
    rest = tuple((f.name, f.default, f.default_factory) for f in fields)
    missing = dataclasses.MISSING
    qualname = cls.__qualname__
    owner: type = cls
    field_set = frozenset(names)
    defaults = {key: default for key, default, _ in rest if default is not missing}
    factories = tuple((key, make) for key, default, make in rest if default is missing and make is not missing)
    required = frozenset(key for key, default, make in rest if default is missing and make is missing)

    def _init(self: object, *args: object, **kwargs: object) -> None:
        if not args and kwargs.keys() <= field_set and required <= kwargs.keys():
            # Every argument by name, as most callers give them: filled in one update, not a
            # setattr per field (a record of 15 fields cost 6 µs the other way).
            values: dict[str, object] = self.__dict__
            values.update(defaults)
            for key, make in factories:
                if key not in kwargs:
                    values[key] = make()
            values.update(kwargs)
            return
        given = len(args)
        if given > count:
            raise TypeError(f"{qualname}.__init__() takes {count + 1} positional arguments but {given + 1} were given")
        for name, value in zip(names, args, strict=False):
            _osetattr(self, name, value)
        if given == count and not kwargs:
            return
        for name, default, factory in rest[given:]:
            value = kwargs.pop(name, missing) if kwargs else missing
            if value is missing:
                if default is not missing:
                    value = default
                elif factory is not missing:
                    value = factory()
                else:
                    raise TypeError(f"{qualname}.__init__() missing required argument: {name!r}")
            _osetattr(self, name, value)
        for name in kwargs:
            if name in names:
                raise TypeError(f"{qualname}.__init__() got multiple values for argument {name!r}")
            raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument {name!r}")

    repr_names = tuple(f.name for f in fields if f.repr)

    @reprlib.recursive_repr()
    def _repr(self: object) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in repr_names)
        return f"{type(self).__qualname__}({inner})"

    compared = _values_of(tuple(f.name for f in fields if f.compare))

    def _eq(self: object, other: object) -> object:
        if other.__class__ is self.__class__:
            return compared(self) == compared(other)
        return NotImplemented

    methods: dict[str, Any] = {"__init__": _init, "__repr__": _repr, "__eq__": _eq}
    if frozen:
        hashed = _values_of(tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))
        field_names = frozenset(names)

        def _hash(self: object) -> int:
            return hash(hashed(self))

        def _setattr(self: Any, name: str, value: object) -> None:
            if type(self) is owner or name in field_names:
                raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
            super(owner, self).__setattr__(name, value)  # type: ignore[arg-type]  # mypy wants a class name

        def _delattr(self: Any, name: str) -> None:
            if type(self) is owner or name in field_names:
                raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
            super(owner, self).__delattr__(name)  # type: ignore[arg-type]  # mypy wants a class name

        methods |= {"__hash__": _hash, "__setattr__": _setattr, "__delattr__": _delattr}
        params = _FrozenFlags.__dataclass_params__  # type: ignore[attr-defined]
    else:
        methods["__hash__"] = None  # as @dataclass(eq=True): unhashable
        params = _MutableFlags.__dataclass_params__  # type: ignore[attr-defined]
    for name, method in methods.items():
        if name in cls.__dict__ and name != "__hash__":
            raise TypeError(f"{qualname} defines {name}; use @dataclass for a class with its own")
        if method is not None:
            method.__name__, method.__qualname__ = name, f"{qualname}.{name}"
        setattr(cls, name, method)
    cls.__dataclass_params__ = params  # type: ignore[attr-defined]
    return cls


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen[C: type](cls: C) -> C:
    """``@dataclass(frozen=True)`` without generated code."""
    return _build(cls, frozen=True)


@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def mutable[C: type](cls: C) -> C:
    """``@dataclass`` without generated code."""
    return _build(cls, frozen=False)
