"""A mount process's claim on its mountpoint folder: held for the process's life, waited for by
an unmount, so that `umount` returns only once the process that served the mount has ended.

The claim is a shared flock(2) on the folder under the mount, taken before mounting over it.
The kernel drops it when the process exits, however it ends (SIGKILL included), and it needs no
pid file or runtime folder; the unmount opens the same folder (uncovered again) and waits until
it can lock it exclusively.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

from kspeedfs.format.errors import MountError

log = logging.getLogger(__name__)

POLL = 0.02  # seconds between tries while a mount process is still ending


def hold(mountpoint: str | os.PathLike[str]) -> int | None:
    """Claim `mountpoint` (before mounting over it) until this process exits; returns the fd,
    which must stay open. None where the folder cannot be locked (no read permission, a
    filesystem without flock): the mount works, an unmount then cannot wait for its end."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        log.info("cannot claim %s (%s): an unmount will not wait for this process", mountpoint, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: never waits, only waited for
    except OSError as e:
        os.close(fd)
        log.info("cannot lock %s (%s): an unmount will not wait for this process", mountpoint, e)
        return None
    return fd


def wait_released(mountpoint: str | os.PathLike[str], timeout: float) -> None:
    """Return once no mount process holds `mountpoint` (call it after the unmount); a one-line
    MountError when one still does after `timeout` seconds."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return  # nothing we can lock, so nothing a mount process could hold either
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError:
                return  # no flock here: hold() could not lock it either
            if os.path.ismount(mountpoint):
                # Mounted again since our unmount (mountd serving its own there): the new
                # mount holds the folder too, and its claim cannot be told from the old one's.
                log.info("%s is mounted again: not waiting for the old mount process", mountpoint)
                return
            if time.monotonic() >= deadline:
                # A copy of the mount in another (private) mount namespace keeps it served.
                raise MountError(
                    f"unmounted {mountpoint}, but its mount process is still running "
                    f"{timeout:.0f}s later (is the mount held in another mount namespace?)"
                )
            time.sleep(POLL)
    finally:
        os.close(fd)  # closing drops our exclusive lock too
