"""A small typed name -> entry registry (verl ``core_algos`` style, with duplicate checks).

Every registry holds entries of ONE type (CONTRIBUTING.md#registries), so every entry is called the same way
and callers never compare names. A misspelt name fails with the list of valid names and, when one is
close, a "did you mean" hint::

    LOSSES: Registry[Callable[[int], int]] = Registry("loss")

    @LOSSES.register("double")
    def _double(x: int) -> int:
        return 2 * x

    LOSSES.get("doubel")   # RegistryError: unknown loss 'doubel' (did you mean 'double'?); valid: double
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "RegistryError"]

E = TypeVar("E")


class RegistryError(ValueError):
    """An unknown or duplicate registry name; the message lists the valid names."""


class Registry(Generic[E]):
    """Maps names to entries of one type ``E``; rejects duplicates; explains unknown names."""

    def __init__(self, kind: str) -> None:
        """``kind`` names what the entries are ("policy objective", "method" ...) in error messages."""
        self.kind = kind
        self._entries: dict[str, E] = {}

    def add(self, name: str, entry: E) -> E:
        """Register ``entry`` under ``name``; a second entry with the same name is an error."""
        if not name or name != name.strip():
            raise RegistryError(f"{self.kind} name {name!r} must be non-empty without surrounding spaces")
        if name in self._entries:
            raise RegistryError(
                f"duplicate {self.kind} {name!r}: already registered; pick another name"
            )
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[E], E]:
        """Decorator form of :meth:`add`; returns the entry unchanged."""

        def decorate(entry: E) -> E:
            return self.add(name, entry)

        return decorate

    def get(self, name: str) -> E:
        """The entry called ``name``; :class:`RegistryError` naming the valid ones if there is none."""
        try:
            return self._entries[name]
        except KeyError:
            raise RegistryError(self.unknown_message(name)) from None

    def check(self, name: str, *, field: str) -> None:
        """Validate a config field at construction: fail (naming ``field``) unless ``name`` exists."""
        if name not in self._entries:
            raise RegistryError(f"{field}: {self.unknown_message(name)}")

    def unknown_message(self, name: str) -> str:
        """``unknown <kind> 'x' (did you mean 'y'?); valid: a, b, c``."""
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; valid: {', '.join(self.names())}"

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
