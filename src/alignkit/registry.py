"""A tiny name -> object registry: variants are picked by name from config, never by dotted path."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from alignkit.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a config name (``"sigmoid"``, ``"ddp"``) to a function or class.

    Use as a decorator: ``@LOSSES.register("ipo")``. Looking up an unknown name raises a
    ``UnknownNameError`` (a ``KeyError`` and a user error) whose message names the registry, the closest valid name and all choices.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}{hint}; choose one of {sorted(self._items)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
