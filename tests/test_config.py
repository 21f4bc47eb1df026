"""Unit tests of kspeedfs.format.config: precedence CLI > environment > file > default, and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kspeedfs.format import config
from kspeedfs.format.config import Settings, load_settings
from kspeedfs.format.errors import InvalidArgument, NotFound
from kspeedfs.format.units import Address


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
