"""Folders for secrets (token files, TLS keys): made 0700 whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path

from kspeedfs.format.errors import InvalidArgument

PRIVATE_MODE = 0o700
# Folders made on the way: readable (a CA folder's parent holds configs others read), never
# writable by others, who could swap the private folder for one of theirs.
PARENT_MODE = 0o755


def make_private_folder(folder: Path) -> None:
    """Create `folder` 0700 and the missing folders above it 0755, whatever the umask; folders
    that exist already are left as they are (`--out .` must not chmod the user's folder)."""
    missing = []
    probe = folder
    while not probe.exists() and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    for path in reversed(missing):
        mode = PRIVATE_MODE if path == folder else PARENT_MODE
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            continue  # made meanwhile by another process: its mode is its maker's
        except OSError as e:
            raise InvalidArgument(f"cannot create the folder {path}: {e.strerror}") from None
        # mkdir's mode went through the umask; set it exactly, on what was made (no symlink).
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
