"""sd_notify without a dependency: one datagram to $NOTIFY_SOCKET per state change."""

from __future__ import annotations

import os
import socket


def notify(*lines: str) -> bool:
    """Send e.g. notify("READY=1", "STATUS=serving"); returns False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract socket namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(addr)
            sock.sendall("\n".join(lines).encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for (seconds), or None when there is none."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
