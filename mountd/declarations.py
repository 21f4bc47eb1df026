"""Mount declarations: one TOML file per mount in the mounts folder, checked before use."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from kspeedfs.format.errors import InvalidArgument, KSpeedError, NotFound
from kspeedfs.format.names import validate_mount_name
from kspeedfs.format.units import parse_address_list
from kspeedfs.fuse.mount import ALLOWED_OPTIONS
from kspeedfs.system.mountinfo import normalize

log = logging.getLogger(__name__)

DEFAULT_MOUNTS_DIR = Path("/etc/kspeedfs/mounts.d")
# The file name (without .toml) is also a systemd instance name: kspeedfs-mount@NAME.service.
DECL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEYS = frozenset({"mountpoint", "dataset", "nodes", "options", "source", "token_file", "config"})
ALL_DATASETS = "all"


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A checked declaration: what `kspeedfs mount` needs to mount it."""

    name: str
    file: Path
    mountpoint: str
    dataset: str | None = None  # None: every dataset, one folder each
    nodes: str | None = None
    options: tuple[str, ...] = ()
    source: str | None = None  # preloaded from here when the dataset is not in the cache
    token_file: str | None = None
    config: str | None = None

    def settings_cli(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "token_file": self.token_file}

    def mount_argv(self, verbose: bool = False) -> list[str]:
        argv = [sys.executable, "-m", "kspeedfs.cli"] + (["-v"] if verbose else [])
        argv += ["mount", self.mountpoint, "--foreground"]
        if self.dataset:
            argv += ["--dataset", self.dataset]
        if self.options:
            argv += ["-o", ",".join(self.options)]
        for flag, value in (
            ("--nodes", self.nodes),
            ("--token-file", self.token_file),
            ("--config", self.config),
        ):
            if value:
                argv += [flag, value]
        return argv


@dataclasses.dataclass(frozen=True)
class InvalidDeclaration:
    """A declaration that cannot be used; reported in the status, never mounted."""

    name: str
    file: Path
    error: str
    mountpoint: str | None = None


def load_declarations(mounts_dir: Path) -> list[Declaration | InvalidDeclaration]:
    """Every *.toml file of `mounts_dir`, sorted by name; a missing folder declares nothing."""
    try:
        files = sorted(p for p in mounts_dir.iterdir() if p.suffix == ".toml")
    except FileNotFoundError:
        log.warning("no mounts folder %s: no mounts declared", mounts_dir)
        return []
    except OSError as e:
        raise InvalidArgument(f"cannot read the mounts folder {mounts_dir}: {e.strerror}") from None
    out: list[Declaration | InvalidDeclaration] = []
    by_mountpoint: dict[str, str] = {}
    for path in files:
        decl = load_declaration(path)
        if isinstance(decl, Declaration):
            other = by_mountpoint.setdefault(decl.mountpoint, decl.name)
            if other != decl.name:
                decl = InvalidDeclaration(
                    decl.name, path, f"mountpoint {decl.mountpoint} is also declared by {other}"
                )
        out.append(decl)
    return out


def find_declaration(mounts_dir: Path, name: str) -> Declaration:
    path = mounts_dir / f"{name}.toml"
    if not path.is_file():
        raise NotFound(f"no mount declaration {path}")
    decl = load_declaration(path)
    if isinstance(decl, InvalidDeclaration):
        raise InvalidArgument(f"{path}: {decl.error}")
    return decl


def load_declaration(path: Path) -> Declaration | InvalidDeclaration:
    name = path.stem
    try:
        if not DECL_NAME_RE.match(name):
            raise InvalidArgument(
                f"bad declaration name {name!r}: use letters, digits, '.', '_' and '-'"
            )
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(f"bad TOML: {e}") from None
        except OSError as e:
            raise InvalidArgument(f"cannot read: {e.strerror}") from None
        return _parse(name, path, data)
    except KSpeedError as e:
        return InvalidDeclaration(name, path, str(e))


def _parse(name: str, path: Path, data: dict[str, Any]) -> Declaration:
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise InvalidArgument(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    mountpoint = data.get("mountpoint")
    if not isinstance(mountpoint, str) or not mountpoint:
        raise InvalidArgument("mountpoint is missing (an absolute path)")
    if not os.path.isabs(mountpoint):
        raise InvalidArgument(f"mountpoint must be an absolute path: {mountpoint!r}")

    dataset = _optional_str(data, "dataset")
    if dataset == ALL_DATASETS:
        dataset = None
    elif dataset is not None:
        validate_mount_name(dataset)

    nodes_value = data.get("nodes")
    if isinstance(nodes_value, list) and all(isinstance(n, str) for n in nodes_value):
        nodes_value = ",".join(nodes_value)
    elif nodes_value is not None and not isinstance(nodes_value, str):
        raise InvalidArgument("nodes must be a string or a list of HOST:PORT strings")
    if nodes_value is not None:
        nodes_value = ",".join(str(a) for a in parse_address_list(nodes_value))

    options_value = data.get("options", [])
    if isinstance(options_value, str):
        options_value = [o.strip() for o in options_value.split(",") if o.strip()]
    if not isinstance(options_value, list) or not all(isinstance(o, str) for o in options_value):
        raise InvalidArgument('options must be a list of strings, e.g. ["allow_other"]')
    for opt in options_value:
        if opt not in ALLOWED_OPTIONS:
            raise InvalidArgument(
                f"unsupported mount option {opt!r} (allowed: {', '.join(sorted(ALLOWED_OPTIONS))})"
            )

    source = _optional_str(data, "source")
    if source is not None:
        if dataset is None:
            raise InvalidArgument("source needs a dataset name to preload it as")
        if not os.path.isabs(source):
            raise InvalidArgument(f"source must be an absolute path: {source!r}")
    token_file = _optional_str(data, "token_file")
    config = _optional_str(data, "config")
    return Declaration(
        name=name,
        file=path,
        mountpoint=normalize(mountpoint),
        dataset=dataset,
        nodes=nodes_value,
        options=tuple(dict.fromkeys(options_value)),
        source=source,
        token_file=os.path.expanduser(token_file) if token_file else None,
        config=os.path.expanduser(config) if config else None,
    )


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{key} must be a non-empty string")
    return value
