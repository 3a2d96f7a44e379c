"""cpulist parsing, root confinement and the tool runner."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memtopo.cpulist import MAX_ID, CpuListError, format_cpulist, parse_cpulist, parse_mask
from memtopo.hostfs import HostFS, HostReadError
from memtopo.runner import RecordedRunner, SubprocessRunner, ToolResult, run_all


@pytest.mark.parametrize(("text", "ids"), [
    ("", ()), ("\n", ()), ("0", (0,)), ("0-3,8,10-11\n", (0, 1, 2, 3, 8, 10, 11)),
    ("0-7:2/4", (0, 1, 4, 5)), ("3,1,2", (1, 2, 3)),
])
def test_parse_cpulist(text: str, ids: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == ids


@pytest.mark.parametrize("text", ["0-", "a", "3-1", "1,,2", f"0-{MAX_ID}", "0-7:0/4", "1:2/4", "-1"])
def test_parse_cpulist_rejects(text: str) -> None:
    with pytest.raises(CpuListError):
        parse_cpulist(text)


def test_parse_mask_words_most_significant_first() -> None:
    assert parse_mask("3\n") == (0, 1)
    assert parse_mask("00000001,00000000") == (32,)
    assert parse_mask("00000000,00000000") == ()
    with pytest.raises(CpuListError):
        parse_mask("xyz")


@given(st.sets(st.integers(0, 2000), max_size=200))
def test_cpulist_round_trip(ids: set[int]) -> None:
    assert parse_cpulist(format_cpulist(ids)) == tuple(sorted(ids))


@given(st.text(max_size=40))
def test_cpulist_garbage_raises_only_its_own_error(text: str) -> None:
    with contextlib.suppress(CpuListError):
        parse_cpulist(text)


def test_hostfs_refuses_paths_that_leave_the_root(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    os.symlink("/etc", tmp_path / "sys" / "escape")
    fs = HostFS.at(tmp_path)
    with pytest.raises(HostReadError, match="leaves the root"):
        fs.read_text("sys/../../etc/passwd")
    # An absolute link means that path in the capture (here: none), never the host's /etc.
    with pytest.raises(HostReadError, match="missing"):
        fs.resolve("sys/escape")
    with pytest.raises(HostReadError, match="missing"):
        fs.read_text("sys/escape/passwd")
    with pytest.raises(HostReadError, match="missing"):
        fs.read_int("sys/nothing")


def test_hostfs_typed_errors(tmp_path: Path) -> None:
    (tmp_path / "n").write_text("12abc\n")
    (tmp_path / "b").write_bytes(b"\xff\xfe")
    fs = HostFS.at(tmp_path)
    with pytest.raises(HostReadError, match="not an integer"):
        fs.read_int("n")
    with pytest.raises(HostReadError, match="UTF-8"):
        fs.read_text("b")
    (tmp_path / "h").write_text("0x20000000\n")
    assert fs.read_int("h", 0) == 0x20000000


def test_runner_failures_are_results_not_exceptions() -> None:
    r = SubprocessRunner()
    assert r.run(["definitely-not-a-tool-xyz"]).failure == "definitely-not-a-tool-xyz: not found"
    assert r.run(["false"]).failure == "false: exit status 1"
    assert "timed out" in (r.run(["sleep", "5"], timeout=0.2).failure or "")
    ok = r.run(["sh", "-c", "echo $LC_ALL"])
    assert ok.ok and ok.stdout.strip() == "C"


def test_recorded_runner_replays_by_argv() -> None:
    rec = RecordedRunner({("npu-smi", "info"): ToolResult(("npu-smi", "info"), 0, "table\n")})
    assert rec.run(["npu-smi", "info"]).stdout == "table\n"
    assert not rec.run(["npu-smi", "info", "-m"]).ok


class _ThreadRecordingRunner:
    """Answers every argv, noting the thread each call ran on."""

    def __init__(self, blocks: bool) -> None:
        self.blocks = blocks
        self.threads: list[str] = []

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        self.threads.append(threading.current_thread().name)
        return ToolResult(tuple(argv), 0, " ".join(argv))


@pytest.mark.parametrize("blocks", [True, False])
def test_run_all_keeps_argv_order_and_threads_only_runners_that_block(blocks: bool) -> None:
    runner = _ThreadRecordingRunner(blocks)
    argvs = [["tool", str(i)] for i in range(3)]
    assert [r.stdout for r in run_all(runner, argvs)] == ["tool 0", "tool 1", "tool 2"]
    on_caller = [t == threading.current_thread().name for t in runner.threads]
    assert on_caller == [not blocks] * 3


def test_recorded_runner_is_called_inline_by_run_all() -> None:
    rec = RecordedRunner({("a",): ToolResult(("a",), 0, "x")})
    assert rec.blocks is False
    assert [r.ok for r in run_all(rec, [["a"], ["b"]])] == [True, False]


def test_one_read_attributes_still_read_a_file_longer_than_one_read(tmp_path: Path) -> None:
    """read_attr, read_cpulist and read_mask take a short read as the whole file; one that fills
    the buffer is read again in full (a captured tree padded far past a page)."""
    from memtopo.hostfs import RECORD_CHUNK

    (tmp_path / "padded").write_bytes(b"\0" * RECORD_CHUNK + b"42\n")
    (tmp_path / "list").write_text(",".join(str(c) for c in range(0, 8000, 2)) + "\n")
    fs = HostFS.at(tmp_path)
    assert fs.read_int("padded") == 42
    assert len((tmp_path / "list").read_bytes()) > RECORD_CHUNK
    assert fs.read_cpulist("list") == tuple(range(0, 8000, 2))
