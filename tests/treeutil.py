"""Trees compared as a whole: what a mount shows against its source, names kept as raw bytes."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def walk(root: Path, content: Callable[[bytes], bytes] = sha256) -> dict[bytes, tuple[str, bytes]]:
    """Relative path -> (kind, `content` of the bytes (their sha256) or link target), names
    kept as raw bytes."""
    out: dict[bytes, tuple[str, bytes]] = {}
    base = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("dir", b"")
            else:
                with open(full, "rb") as f:
                    out[rel] = ("file", content(f.read()))
    return out
