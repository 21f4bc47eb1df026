"""Validation of dataset names: they become folder names, file names and wire fields."""

from __future__ import annotations

import re

from kspeedfs.format.errors import InvalidArgument

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def validate_name(name: str) -> str:
    # fullmatch: with match, "$" also accepts a trailing newline ("name\n").
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidArgument(
            f"bad dataset name {name!r}: use 1-64 of a-z 0-9 . _ - starting with a letter or digit"
        )
    return name
