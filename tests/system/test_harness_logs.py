"""The check of what the test processes logged: conftest's autouse fixture fails a test whose
node or mount logged a traceback, unless the test's `tracebacks` mark expects it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NodeProcess, log_sizes, logged_tracebacks, tracebacks_since

pytest_plugins = ["pytester"]

PLAIN = """\
2026-01-01 00:00:00 INFO kspeedfs.node: serving
2026-01-01 00:00:01 ERROR kspeedfs.node.ops: internal error in op stage
Traceback (most recent call last):
  File "kspeedfs/node/ops.py", line 60, in dispatch
    return await handler(request)

  File "kspeedfs/node/preload.py", line 280, in op_stage
    raise RuntimeError("a bug")
RuntimeError: a bug
2026-01-01 00:00:02 INFO kspeedfs.node: still serving
"""

GROUP = """\
ERROR kspeedfs.node.server: unexpected error on a connection; closing it
  + Exception Group Traceback (most recent call last):
  |   File "kspeedfs/node/server.py", line 130, in serve
  | ExceptionGroup: one (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "kspeedfs/node/server.py", line 120, in handle
    | ValueError: inner
    +------------------------------------
INFO kspeedfs.node: after
"""


def test_a_traceback_is_found_with_its_record_and_exception() -> None:
    assert logged_tracebacks("INFO nothing here\n") == []
    (tb,) = logged_tracebacks(PLAIN)
    assert tb.startswith("2026-01-01 00:00:01 ERROR kspeedfs.node.ops: internal error")
    assert tb.endswith("RuntimeError: a bug")
    assert "still serving" not in tb
    (group,) = logged_tracebacks(GROUP)
    assert group.startswith("ERROR kspeedfs.node.server") and "ValueError: inner" in group
    assert "INFO kspeedfs.node: after" not in group


INNER = """
import subprocess

import pytest

from kspeedfs.testing.process import STARTED

TRACEBACK = (
    "ERROR kspeedfs.node.ops: internal error in op x\\n"
    "Traceback (most recent call last):\\n"
    '  File "x.py", line 1, in f\\n'
    "RuntimeError: planted\\n"
)


def plant(tmp_path, text):
    log = tmp_path / "node.log"
    log.write_text("INFO kspeedfs.node: serving\\n")
    STARTED.append((log, subprocess.Popen(["true"])))
    with open(log, "a") as f:
        f.write(text)


def test_unmarked(tmp_path):
    plant(tmp_path, TRACEBACK)


def test_clean_log(tmp_path):
    plant(tmp_path, "INFO kspeedfs.node: a warning-free day\\n")


@pytest.mark.tracebacks("RuntimeError: planted")
def test_expected(tmp_path):
    plant(tmp_path, TRACEBACK)


@pytest.mark.tracebacks("KeyError")
def test_another_expected(tmp_path):
    plant(tmp_path, TRACEBACK)


@pytest.mark.tracebacks
def test_any_expected(tmp_path):
    plant(tmp_path, TRACEBACK)
"""


def test_the_fixture_fails_a_test_whose_process_logged_an_unexpected_traceback(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_unmarked*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_another_expected*"])
    assert "RuntimeError: planted" in result.stdout.str()


@pytest.mark.tracebacks("RuntimeError: planted")  # the fixture reads it again at teardown
def test_a_started_node_is_watched(node: NodeProcess) -> None:
    sizes = log_sizes()
    assert node.log_path in sizes
    with open(node.log_path, "a") as f:  # as the node would print it
        f.write("ERROR kspeedfs.node.ops: planted\nTraceback (most recent call last):\n")
        f.write('  File "x.py", line 1, in f\nRuntimeError: planted\n')
    found = tracebacks_since(sizes)
    assert [(path, tb.splitlines()[-1]) for path, tb in found] == [
        (node.log_path, "RuntimeError: planted")
    ]
    assert node.log_path in log_sizes()  # still running: still watched
