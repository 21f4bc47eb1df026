"""Running test code as an unprivileged user: a forked child that drops to a uid (the
interpreter and modules are loaded already: the venv's python is not reachable by that uid)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

NOBODY = 65534


def as_user(uid: int, groups: list[int], work: Callable[[], Any]) -> Any:
    """work() in a forked child that dropped to uid (gid 65534, `groups`); its JSON result."""
    return in_child(work, uid, groups)


def in_child(work: Callable[[], Any], uid: int | None = None, groups: Sequence[int] = ()) -> Any:
    """work() in a forked child (as a DataLoader worker is made), dropped to `uid` (gid 65534,
    `groups`) when one is given; its JSON result. The test fails when the child does."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            if uid is not None:
                os.setgroups(list(groups))
                os.setgid(NOBODY)
                os.setuid(uid)
            result = work()
            with os.fdopen(write_end, "w") as out:
                json.dump(result, out)
            code = 0
        except BaseException as e:  # reported to the parent through the exit code
            with contextlib.suppress(Exception):
                os.write(2, f"child failed: {e!r}\n".encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, text
    return json.loads(text)
