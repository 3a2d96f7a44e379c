"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_like(scalars: st.SearchStrategy[Any], keys: st.SearchStrategy[str], *, max_leaves: int,
              list_size: int = 4, dict_size: int = 4) -> st.SearchStrategy[Any]:
    """Decoded-JSON-shaped garbage: ``scalars`` nested in lists and in objects keyed by ``keys``
    (the fields a parser knows, so that the garbage reaches past its first check)."""
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=list_size) | st.dictionaries(keys, inner, max_size=dict_size),
        max_leaves=max_leaves,
    )
