"""The exception tree, its errno mapping and the CLI exit codes."""

from __future__ import annotations

import errno


class KSpeedError(Exception):
    """Base of every error kspeedfs raises on purpose; the message is one line for the user."""

    errno: int = errno.EIO
    exit_code: int = 1


class NodeUnreachable(KSpeedError):
    errno = errno.EHOSTUNREACH
    exit_code = 3


class Fenced(NodeUnreachable):
    """A node whose etcd registration lapsed (or was replaced) tried to change the catalog:
    it joins again, then acts from what it reads then."""


class NotFound(KSpeedError):
    errno = errno.ENOENT
    exit_code = 4


class NoSuchPath(NotFound, FileNotFoundError):  # type: ignore[misc]  # errno: ours, an int
    """A path a file-system API asked for is not there: also the FileNotFoundError that fsspec,
    pyarrow and datasets catch."""


class InvalidArgument(KSpeedError):
    errno = errno.EINVAL
    exit_code = 5


class SourceNotVisible(InvalidArgument):
    """A node cannot read a preload's source: the coordinator pushes its segments instead."""


class AlreadyExists(KSpeedError):
    errno = errno.EEXIST
    exit_code = 6


class NoSpace(KSpeedError):
    errno = errno.ENOSPC
    exit_code = 7


class MountError(KSpeedError):
    errno = errno.EBUSY
    exit_code = 8


class AuthError(KSpeedError):
    errno = errno.EACCES
    exit_code = 9


class DataError(KSpeedError):
    errno = errno.EIO
    exit_code = 10


class StaleDataset(DataError):
    """The dataset instance a reader opened is no longer held (unloaded, or loaded again)."""


class SourceChanged(DataError):
    """A source file is no longer as listed: a snapshot cannot be served from it."""


class SourceModified(SourceChanged):
    """A source file is still a file but of another version (rewritten, resized, replaced):
    a load from a new scan may copy it whole."""


class ProtocolError(KSpeedError):
    errno = errno.EPROTO
    exit_code = 11


class ReadOnly(KSpeedError):
    errno = errno.EROFS
    exit_code = 12


class ReadOnlyFileSystem(ReadOnly, PermissionError):  # type: ignore[misc]  # as NoSuchPath
    """A write through a file-system API (fsspec): also the PermissionError callers expect."""


class InUse(KSpeedError):
    """A folder a running node holds (a removal of its folders is refused)."""

    errno = errno.EBUSY
    exit_code = 13


class InternalError(KSpeedError):
    """A handler failed in a way nobody planned for: answered in one line, logged in full."""


# Errors cross the wire by class name; the client re-raises the same class.
def _with_subclasses(cls: type[KSpeedError]) -> list[type[KSpeedError]]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _with_subclasses(sub)]


ERROR_CLASSES: dict[str, type[KSpeedError]] = {
    cls.__name__: cls for cls in _with_subclasses(KSpeedError)
}


def error_from_wire(kind: str, message: str) -> KSpeedError:
    return ERROR_CLASSES.get(kind, KSpeedError)(message)


EXIT_CODES_DOC = """\
exit codes:
  0  success
  1  unexpected error
  2  bad command line
  3  node not running or unreachable
  4  not found (source, dataset)
  5  invalid argument (bad name, source not a folder, bad option)
  6  already exists (dataset already loaded)
  7  not enough memory budget
  8  mountpoint missing, busy or mount failed
  9  authentication refused
 10  data error (unreadable or corrupt data)
 11  protocol error
 12  read-only
 13  in use (a node runs on the folder)"""
