"""Small checks shared by the channel configs' ``__post_init__`` (one error wording in one place)."""

from __future__ import annotations

__all__ = ["check_one_of"]


def check_one_of(field: str, value: object, valid: tuple[object, ...]) -> None:
    """Raise ``ValueError`` naming ``field`` and the valid values unless ``value`` is one of ``valid``."""
    if value not in valid:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, valid))}; got {value!r}")
