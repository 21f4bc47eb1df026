"""Unit tests of kspeedfs.format.config: precedence CLI > environment > file > default, and errors."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kspeedfs.format import config, setting_rules
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.units import MAX_SIZE, Address


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Keep a config file in /etc on this machine out of the tests.
    monkeypatch.setattr(config, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings({}, env={})
    assert s == Settings()
    assert s.listen == Address("127.0.0.1", 7420)
    assert s.nodes == [Address("127.0.0.1", 7420)]
    assert s.shm_dir == Path("/dev/shm/kspeedfs")


def test_cli_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    f = write(
        tmp_path / "k.toml",
        'memory = "1GiB"\nshm_dir = "/dev/shm/from-file"\ntimeout = 3\nlog_level = "debug"\n',
    )
    env = {"KSPEEDFS_MEMORY": "2GiB", "KSPEEDFS_SHM_DIR": "/dev/shm/from-env"}
    s = load_settings({"memory": "3GiB", "listen": None}, env=env, config_file=f)
    assert s.memory == "3GiB"  # CLI
    assert s.shm_dir == Path("/dev/shm/from-env")  # env over file
    assert s.timeout == 3.0  # file over default
    assert s.log_level == "DEBUG"
    assert s.listen == Settings().listen  # a CLI value of None means "not given"
    assert load_settings({}, env=env, config_file=f).memory == "2GiB"
    assert load_settings({}, env={}, config_file=f).memory == "1GiB"
    assert s.memory_budget() == 3 << 30


def test_config_file_named_by_env_and_sections(tmp_path: Path) -> None:
    f = write(
        tmp_path / "k.toml",
        '[node]\nlisten = "0.0.0.0:7500"\nsegment-size = "8MiB"\nverify_on_start = false\n'
        '[client]\nnodes = ["a:1", "b"]\n',
    )
    s = load_settings({}, env={"KSPEEDFS_CONFIG": str(f)})
    assert s.listen == Address("0.0.0.0", 7500)
    assert s.segment_size == 8 << 20
    assert s.verify_on_start is False
    assert s.nodes == [Address("a", 1), Address("b", 7420)]
    # An explicit file beats the one the environment names.
    other = write(tmp_path / "o.toml", 'listen = "127.0.0.1:7600"\n')
    s = load_settings({}, env={"KSPEEDFS_CONFIG": str(f)}, config_file=other)
    assert s.listen == Address("127.0.0.1", 7600)


def test_env_values_are_converted() -> None:
    env = {
        "KSPEEDFS_NODES": "n1:7421,n2",
        "KSPEEDFS_SEGMENT_SIZE": "4MiB",
        "KSPEEDFS_VERIFY_ON_START": "no",
        "KSPEEDFS_TOKEN_FILE": "~/tok",
        "KSPEEDFS_UNRELATED": "ignored",
    }
    s = load_settings({}, env=env)
    assert s.nodes == [Address("n1", 7421), Address("n2", 7420)]
    assert s.segment_size == 4 << 20
    assert s.verify_on_start is False
    assert not str(s.token_file).startswith("~")


def test_memory_percentage_is_of_the_shm_filesystem(tmp_path: Path) -> None:
    s = load_settings({"memory": "50%", "shm_dir": str(tmp_path / "not" / "yet")}, env={})
    import os

    st = os.statvfs(tmp_path)
    assert s.memory_budget() == int(st.f_blocks * st.f_frsize * 0.5)


@pytest.mark.parametrize(
    ("layer", "key", "value", "origin"),
    [
        ("cli", "memory", "lots", "command line"),
        ("env", "KSPEEDFS_LISTEN", "host:port", "environment"),
        ("env", "KSPEEDFS_VERIFY_ON_START", "maybe", "environment"),
        ("env", "KSPEEDFS_TIMEOUT", "soon", "environment"),
        ("file", "segment_size", '"huge"', "config file"),
    ],
)
def test_bad_values_name_their_origin(
    tmp_path: Path, layer: str, key: str, value: str, origin: str
) -> None:
    cli: dict[str, str] = {}
    env: dict[str, str] = {}
    f = None
    if layer == "cli":
        cli[key] = value
    elif layer == "env":
        env[key] = value
    else:
        f = write(tmp_path / "k.toml", f"{key} = {value}\n")
    with pytest.raises(InvalidArgument, match=origin):
        load_settings(cli, env=env, config_file=f)


def test_unknown_setting_in_file(tmp_path: Path) -> None:
    f = write(tmp_path / "k.toml", 'memroy = "1GiB"\n')
    with pytest.raises(InvalidArgument, match="unknown setting 'memroy'"):
        load_settings({}, env={}, config_file=f)


def test_broken_and_missing_config_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="config file"):
        load_settings({}, env={}, config_file=write(tmp_path / "bad.toml", "memory = \n"))
    with pytest.raises(NotFound):
        load_settings({}, env={}, config_file=tmp_path / "missing.toml")
    with pytest.raises(NotFound):
        load_settings({}, env={"KSPEEDFS_CONFIG": str(tmp_path / "missing.toml")})


def test_segment_size_floor() -> None:
    with pytest.raises(InvalidArgument, match="segment_size"):
        load_settings({"segment_size": "1K"}, env={})


# One bad value of every setting (tests/system/test_cli_settings.py runs the CLI ones for real).
BAD = {
    "listen": "host:70000",
    "nodes": "a:1,b:0",
    "shm_dir": "relative/shm",
    "memory": "-50%",
    "segment_size": "1K",
    "token_file": "",
    "users_file": "relative/users",
    "user": "no/slash",
    "password": "pw\x00",
    "verify_on_start": "maybe",
    "lease_ttl": "0",
    "timeout": "nan",
    "log_level": "chatty",
    "transport": "udp",
    "rdma_device": "mlx5_0\n",
    "rdma_gid_index": "-2",
    "spill_dir": "relative/spill",
    "spill": "-1",
    "scrub_rate": "fast",
    "source_check_interval": "-inf",
    "eviction": "fifo",
    "group": "a\tb",
    "access": "closed",
    "source_roots": "/data,relative",
    "socket": "/run/" + "s" * 120,
    "node_user": "no-such-user-here",
    "tls_cert": "cert\x00",
    "tls_key": "key\x00",
    "tls_ca": "ca\x00",
    "fuse_workers": "100000",
    "fuse_read_ahead": "lots",
    "fuse_poll_us": "200000",
    "fuse_uring": "sometimes",
    "decode_workers": "-1",
    "etcd": "http://etcd:99999",
    "cluster": "a/b",
    "member_ttl": "inf",
    "heal_after": "1e400",
    "dns_refresh": "-1",
    "health_table": "relative/health",
    "metrics_listen": "host:port",
}


def test_every_setting_has_one_rule_and_a_bad_value_here() -> None:
    """A setting added to Settings without a row in the table (or a bad value here) fails."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert set(setting_rules.RULES) == fields
    assert set(BAD) == fields


@pytest.mark.parametrize("layer", ["file", "env", "cli"])
@pytest.mark.parametrize("key", sorted(BAD))
def test_each_bad_setting_names_itself_and_where_it_came_from(
    tmp_path: Path, layer: str, key: str
) -> None:
    value, f = BAD[key], None
    cli, env = {}, {}
    if layer == "file":
        f = write(tmp_path / "k.toml", f"{key} = {json.dumps(value)}\n")
        origin = f"from the config file {f}:"
    elif layer == "env":
        env[f"KSPEEDFS_{key.upper()}"] = value
        origin = f"from the environment (KSPEEDFS_{key.upper()}):"
    else:
        cli[key] = value
        origin = f"from the command line (--{key.replace('_', '-')}):"
    with pytest.raises(InvalidArgument) as e:
        load_settings(cli, env=env, config_file=f)
    assert str(e.value).startswith(f"{key} {origin}"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("timeout = true", "not a number"),
        ("fuse_workers = 1.5", "not an integer"),
        ("segment_size = 1.5e6", "not a size"),
        ("nodes = 5", "expected a string"),
        ("shm_dir = 3", "expected a string"),
        ("verify_on_start = 1", "expected a string"),
        ("memory = -1", "must not be negative"),
        ("source_roots = [1]", "expected a string"),
        ("etcd = [true]", "expected a string"),
    ],
)
def test_toml_values_of_the_wrong_type(tmp_path: Path, text: str, fragment: str) -> None:
    f = write(tmp_path / "k.toml", text + "\n")
    with pytest.raises(InvalidArgument, match=fragment):
        load_settings({}, env={}, config_file=f)


def test_the_caller_names_its_own_flags_and_origin() -> None:
    with pytest.raises(InvalidArgument, match=r"^fuse_workers from the command line \(--workers\)"):
        load_settings({"fuse_workers": "-1"}, env={}, cli_names={"fuse_workers": "--workers"})
    with pytest.raises(InvalidArgument, match=r"^timeout from the mount options \(timeout=\)"):
        load_settings(
            {"timeout": "0"}, env={}, cli_origin="mount options", cli_names={"timeout": "timeout="}
        )


def test_settings_that_go_together_name_where_the_one_given_came_from(tmp_path: Path) -> None:
    env = {"KSPEEDFS_TLS_CERT": str(tmp_path / "c.crt")}
    with pytest.raises(InvalidArgument, match=r"go together.*environment \(KSPEEDFS_TLS_CERT\)"):
        load_settings({}, env=env)
    with pytest.raises(InvalidArgument, match=r"spill_dir, spill go together.*--spill\)"):
        load_settings({"spill": "1GiB"}, env={})
    with pytest.raises(InvalidArgument, match=r"go together.*--spill-dir\)"):
        load_settings({"spill_dir": str(tmp_path)}, env={})
    s = load_settings({"spill_dir": str(tmp_path), "spill": "1GiB"}, env={})
    assert s.spill == str(1 << 30)


def test_a_config_path_must_be_a_regular_utf8_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"\(from --config\) is not a regular file"):
        load_settings({}, env={}, config_file=tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: an open without O_NONBLOCK would hang here
    with pytest.raises(InvalidArgument, match=r"\(from KSPEEDFS_CONFIG\) is not a regular file"):
        load_settings({}, env={"KSPEEDFS_CONFIG": str(fifo)})
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('shm_dir = "/dev/shm/caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(InvalidArgument, match=r"is not UTF-8 \(byte 23\)"):
        load_settings({}, env={}, config_file=latin1)
    twice = write(tmp_path / "twice.toml", "[node]\ntimeout = 1\n[client]\ntimeout = 2\n")
    with pytest.raises(InvalidArgument, match="'timeout' is given twice"):
        load_settings({}, env={}, config_file=twice)


def test_the_default_config_file_is_checked_too(tmp_path: Path) -> None:
    config.DEFAULT_CONFIG_FILE.mkdir()  # the fixture's absent.toml, now a folder
    with pytest.raises(InvalidArgument, match="absent.toml is not a regular file"):
        load_settings({}, env={})


def test_memory_shares_and_sizes_at_their_edges(tmp_path: Path) -> None:
    shm = str(tmp_path)
    assert load_settings({"memory": "0%", "shm_dir": shm}, env={}).memory_budget() == 0
    full = load_settings({"memory": "100%", "shm_dir": shm}, env={}).memory_budget()
    st = os.statvfs(tmp_path)
    assert full == st.f_blocks * st.f_frsize
    for bad in ("nan%", "inf%", "-50%", "100.5%", "1e2%", "%", "5_0%", "50%%"):
        with pytest.raises(InvalidArgument, match="memory from the command line"):
            load_settings({"memory": bad}, env={})


# Generated values for every setting: each is refused in one line naming the setting and its
# origin, or it gives a value that the node and clients can use as it is.
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
_NUMBER = st.one_of(
    st.floats().map(repr),
    st.integers().map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-0", "0", "1_0", " 5 "]),
)
_VALUES = st.one_of(
    _TEXT, _NUMBER, _NUMBER.map(lambda s: s + "%"), _NUMBER.map(lambda s: s + "MiB")
)


def _usable(s: Settings) -> None:
    for f in dataclasses.fields(Settings):
        value = getattr(s, f.name)
        if isinstance(value, float):
            assert math.isfinite(value) and 0 <= value <= setting_rules.MAX_SECONDS, f.name
    assert s.timeout > 0 and s.lease_ttl > 0 and s.member_ttl > 0
    assert 0 <= s.memory_budget() <= MAX_SIZE
    assert 4096 <= s.segment_size <= MAX_SIZE and 0 <= int(s.spill) <= MAX_SIZE
    assert 0 <= s.fuse_workers <= 1024 and 0 <= s.decode_workers <= 1024
    assert s.shm_dir.is_absolute() and s.log_level in logging.getLevelNamesMapping()
    assert all(0 < a.port < 65536 for a in s.nodes) and 0 <= s.listen.port < 65536


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(BAD)), _VALUES, st.sampled_from(["env", "cli"]))
def test_any_value_is_refused_in_one_line_or_usable(key: str, value: str, layer: str) -> None:
    if layer == "env":
        if "\x00" in value:
            return  # no environment can hold one
        source, where = {"env": {f"KSPEEDFS_{key.upper()}": value}}, f"KSPEEDFS_{key.upper()}"
    else:
        source, where = {"cli": {key: value}}, f"--{key.replace('_', '-')}"
    try:
        s = load_settings(source.get("cli", {}), env=source.get("env", {}))
    except InvalidArgument as e:
        message = str(e)
        assert "\n" not in message
        assert message.startswith(key) or " go together" in message, message
        assert f"({where})" in message, message
        return
    _usable(s)
