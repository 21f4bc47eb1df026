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


def split_variant(name: str) -> tuple[str, int | None]:
    """A mount's dataset argument: `NAME` → (NAME, None); `NAME@N`, the dataset's decoded
    variant of size N as the mount shows it (fuse/variants.py) → (NAME, N). Checked."""
    base, at, size = name.partition("@") if isinstance(name, str) else (name, "", "")
    validate_name(base)
    if not at:
        return base, None
    if not size.isascii() or not size.isdigit() or len(size) > 5 or int(size) > 65535:
        raise InvalidArgument(f"bad decoded size in {name!r}: NAME@N, N from 0 to 65535")
    return base, int(size)


def validate_mount_name(name: str) -> str:
    """A dataset, or its decoded variant `NAME@N`, to mount at a mountpoint's root."""
    split_variant(name)
    return name
