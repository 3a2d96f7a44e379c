"""``memtopo topo`` / ``memtopo gather`` end to end, on this host and on captured roots."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format

from memtopo.cli.main import main
from memtopo.cpulist import parse_cpulist
from memtopo.discovery.capture import CaptureError, open_root
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_XML, LAB_CAPTURES, REPO, extracted

MEMTOPO = [sys.executable, "-m", "memtopo.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTOPO, *args], capture_output=True, text=True, cwd=REPO, check=False)


def parse(text: str) -> pb.MemoryTopology:
    return json_format.Parse(text, pb.MemoryTopology())


def node_memtotals() -> dict[int, int]:
    """Each online node's MemTotal in bytes, as the kernel says now."""
    node_dir = Path("/sys/devices/system/node")
    totals = {}
    for node in parse_cpulist((node_dir / "online").read_text()):
        with (node_dir / f"node{node}/meminfo").open() as f:
            totals[node] = next(int(line.split()[3]) for line in f if "MemTotal" in line) * 1024
    return totals


def while_memory_holds_still[T](run: Callable[[], T]) -> tuple[T, dict[int, int]]:
    """``run()`` during a moment the host's node sizes did not change (some VMs resize memory all the time:
    seen here, node 0's MemTotal moved by hundreds of MB within a test); skips where they never hold still."""
    for _ in range(5):
        before = node_memtotals()
        result = run()
        if node_memtotals() == before:
            return result, before
    pytest.skip("this host's memory size changed during every attempt")


def test_host_json_parses_back_and_agrees_with_sys_and_proc() -> None:
    res, memtotals = while_memory_holds_still(lambda: run_cli("topo", "--format", "json"))
    assert res.returncode == 0, res.stderr
    raw = json.loads(res.stdout)
    assert "total_capacity_bytes" in raw and "numa_nodes" in raw  # snake_case names, as in the .proto
    topo = parse(res.stdout)
    node_dir = Path("/sys/devices/system/node")
    online_nodes = parse_cpulist((node_dir / "online").read_text())
    assert [n.id for n in topo.numa_nodes if n.state == pb.NUMA_NODE_STATE_ONLINE] == list(online_nodes)
    for n in topo.numa_nodes:
        if n.state == pb.NUMA_NODE_STATE_ONLINE:
            assert list(n.cpus) == list(parse_cpulist((node_dir / f"node{n.id}/cpulist").read_text()))
            assert n.memory_bytes == memtotals[n.id]
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    assert list(topo.allowed_cpus) == list(parse_cpulist(status["Cpus_allowed_list"]))
    assert list(topo.allowed_memory_nodes) == list(parse_cpulist(status["Mems_allowed_list"]))
    assert list(topo.cpus.online) == list(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))
    assert topo.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert len(topo.fingerprint) == 64


def test_gather_then_topo_on_the_capture_gives_the_host_fingerprint(tmp_path: Path) -> None:
    out = tmp_path / "host.tar.gz"

    def gather_and_discover() -> pb.MemoryTopology:
        assert main(["gather", str(out)]) == 0
        return parse(run_cli("topo", "--format", "json").stdout)

    host, _ = while_memory_holds_still(gather_and_discover)
    res = run_cli("topo", "--root", str(out), "--format", "json")
    assert res.returncode == 0, res.stderr
    captured = parse(res.stdout)
    assert captured.fingerprint == host.fingerprint, _diff(host, captured)


def _diff(a: pb.MemoryTopology, b: pb.MemoryTopology) -> str:
    ja = json_format.MessageToDict(a, preserving_proto_field_name=True)
    jb = json_format.MessageToDict(b, preserving_proto_field_name=True)
    return "\n".join(f"{k}: {ja.get(k)!r:.300} != {jb.get(k)!r:.300}" for k in sorted(set(ja) | set(jb))
                     if ja.get(k) != jb.get(k) and k not in ("discovery_time", "fingerprint", "source_root"))


def test_topo_reads_a_tarball_root_and_an_hwloc_xml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--root", str(LAB_CAPTURES / "dual-socket-cxl-tiered.tar.gz")]) == 0
    text = capsys.readouterr().out
    assert "cxl-attached" in text and "memory_tier22" in text and "region0" in text
    assert "possible-offline" not in text  # in -tiered node 3 is online
    assert main(["topo", "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "json"]) == 0
    topo = parse(capsys.readouterr().out)
    assert len([p for p in topo.pci_devices if p.kind == pb.PCI_DEVICE_KIND_GPU]) == 16


def test_bad_roots_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--root", str(tmp_path / "missing")]) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["topo", "--root", str(tmp_path / "notes.txt")]) == 2
    assert "neither a directory nor a tar archive" in capsys.readouterr().err
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"not a tarball")
    assert main(["topo", "--root", str(bogus)]) == 2
    assert main(["topo", "--hwloc-xml", str(tmp_path / "nope.xml")]) == 2


def test_tarball_with_path_traversal_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tf:
        data = b"owned\n"
        info = tarfile.TarInfo("../../escaped")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(CaptureError), open_root(evil):
        pass
    assert not (tmp_path.parent / "escaped").exists()


def test_gather_keeps_what_the_probes_read(tmp_path: Path) -> None:
    out = tmp_path / "c.tar.gz"
    assert main(["gather", str(out)]) == 0
    with tarfile.open(out) as tf:
        names = set(tf.getnames())
    for needed in ("proc/self/status", "sys/devices/system/node/online", "sys/devices/system/cpu/online",
                   "proc/sys/kernel/random/boot_id"):
        assert needed in names
    assert not any(os.path.basename(n) in ("remove", "rescan", "reset") for n in names)
    assert not any(n.startswith(("/", "..")) for n in names)


def test_topo_process_writes_its_whole_output_before_its_quick_exit() -> None:
    """`topo` ends without the interpreter's teardown: what it wrote to a pipe still arrives whole,
    a short text that sits in the stream's buffer as well as a JSON document larger than it, with the
    same exit status and error line as before."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

    def topo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MEMTOPO, "topo", *args], capture_output=True, text=True, cwd=REPO, env=buffered,
                              check=False)

    text = topo("--hwloc-xml", str(HWLOC_XML / "8intel64-4n2t-memattrs.xml"))
    assert text.returncode == 0, text.stderr
    assert 0 < len(text.stdout) < 8192 and text.stdout.endswith("\n")
    assert "total capacity 4.0 GiB in 4 domain(s)" in text.stdout
    res = topo("--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "json")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout) > 16384 and json.loads(res.stdout)["sources"]
    bad = topo("--root", "/nonexistent/root")
    assert bad.returncode == 2
    assert bad.stderr == "memtopo: /nonexistent/root: no such file or directory\n"


# ---- what a newcomer types first -------------------------------------------------------------------
def test_bare_memtopo_and_a_bare_command_group_print_their_help() -> None:
    bare = run_cli()
    assert bare.returncode == 2 and bare.stderr == ""
    assert bare.stdout.startswith("usage: memtopo ") and "topo" in bare.stdout and "serve" in bare.stdout
    assert "error" not in bare.stdout
    for group, member in (("plan", "cpu-binding"), ("k8s", "nrt")):
        res = run_cli(group)
        assert res.returncode == 2 and res.stdout.startswith(f"usage: memtopo {group} ") and member in res.stdout


def test_gather_replaces_an_existing_file_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "host.tar.gz"
    out.write_bytes(b"an earlier capture")
    refused = run_cli("gather", str(out))
    assert refused.returncode == 2 and "exists" in refused.stderr and "--force" in refused.stderr
    assert out.read_bytes() == b"an earlier capture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.tar.gz"]
    replaced = run_cli("gather", "--force", str(out))
    assert replaced.returncode == 0, replaced.stderr
    with tarfile.open(out) as tf:
        assert "sys/devices/system/node/online" in tf.getnames()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.tar.gz"]  # no temporary file left beside it


def test_exec_of_a_command_it_cannot_run_exits_as_a_shell_would(tmp_path: Path) -> None:
    """127: no such command; 126: found but not executable; 2: a bad option of memtopo's own."""
    text = tmp_path / "notes.txt"
    text.write_text("not a program\n")
    missing = run_cli("exec", "--", str(tmp_path / "nonexistent"))
    assert missing.returncode == 127 and "No such file" in missing.stderr
    assert run_cli("exec", "--", "memtopo-no-such-command").returncode == 127
    not_executable = run_cli("exec", "--", str(text))
    assert not_executable.returncode == 126 and "Permission denied" in not_executable.stderr
    assert run_cli("exec", "--", str(tmp_path)).returncode == 126
    assert run_cli("exec", "--membind", "x", "--", "true").returncode == 2
    ok = run_cli("exec", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert ok.returncode == 7  # the command's own status


def _command_paths() -> list[tuple[str, ...]]:
    from memtopo.cli.main import build_parser
    from memtopo.cli.manual import commands

    return [words for words, _ in commands(build_parser())]


def test_the_command_tree_is_walked_whole() -> None:
    paths = _command_paths()
    assert {("topo",), ("plan", "cpu-binding"), ("controller", "nodes"), ("k8s", "nrt"), ("completion",),
            ("man",)} <= set(paths)
    assert len(paths) == len(set(paths)) > 20


def test_bash_completion_completes_every_command_and_its_options() -> None:
    """The script `memtopo completion bash` prints, loaded into a real bash: at each level it offers
    the commands below it, and after a command it offers that command's options."""
    from memtopo.cli.main import build_parser
    from memtopo.cli.manual import commands

    script = run_cli("completion", "bash")
    assert script.returncode == 0, script.stderr
    checks = []
    for words, parser in commands(build_parser()):
        options = sorted(o for a in parser._actions if a.help != argparse.SUPPRESS
                         for o in a.option_strings if o.startswith("--"))
        checks.append((words, options))
    probe = "\n".join(
        f'COMP_WORDS=(memtopo {" ".join(words)} "{prefix}"); COMP_CWORD={len(words) + 1}; COMPREPLY=(); '
        f'_shtab_memtopo; echo "{" ".join(words)}|{prefix}|${{COMPREPLY[*]}}"'
        for words, _ in checks for prefix in ("", "--"))
    res = subprocess.run(["bash", "-c", script.stdout + "\n" + probe], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    offered = {}
    for line in res.stdout.splitlines():
        path, prefix, reply = line.split("|")
        offered[(path, prefix)] = set(reply.split())
    paths = {words for words, _ in checks}
    for words, options in checks:
        below = {p[len(words)] for p in paths if len(p) == len(words) + 1 and p[:len(words)] == words}
        assert below <= offered[(" ".join(words), "")], words
        assert set(options) <= offered[(" ".join(words), "--")], words


def test_zsh_completion_has_every_command() -> None:
    script = run_cli("completion", "zsh")
    assert script.returncode == 0 and script.stdout.startswith("#compdef memtopo")
    for words in _command_paths():
        assert "_shtab_memtopo" + "".join(f"_{w.replace('-', '_')}" for w in words) + "_options=(" in script.stdout


def test_the_manual_page_has_every_command_and_man_formats_it() -> None:
    page = run_cli("man")
    assert page.returncode == 0 and page.stdout.startswith(".TH MEMTOPO 1 ")
    sections = [line for line in page.stdout.splitlines() if line.startswith(".SH ")]
    for words in _command_paths()[1:]:
        assert f'.SH "{" ".join(("memtopo", *words)).upper()}"'.replace("-", "\\-") in sections, words
    assert run_cli("man").stdout == page.stdout  # the same bytes every time: no date
    if shutil.which("man") is None:
        pytest.skip("no man on this machine to format the page")
    shown = subprocess.run(["man", "-l", "-"], input=page.stdout, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "0"}, check=False)
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    plain = re.sub(".\b", "", shown.stdout)
    assert "MEMTOPO PLAN XPU" in plain and "cross_half_fallback" in plain  # an epilog, as --help shows it
    assert "memtopo plan hccs --request -" in plain  # minus signs survive


def test_each_plan_policy_help_shows_a_request_that_the_policy_takes(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The example in `memtopo plan POLICY --help` is decided as it stands, and every field the help
    names is one the policy knows (an unknown key is refused by name). In this process: a run per
    field, each a discovery of the root where the policy needs one."""
    from memtopo.cli.plan_requests import REQUESTS
    from tests.cli.main_call import memtopo_main

    gh200 = str(extracted(REPO / "tests/fixtures/gh200/root.tar.gz"))
    for policy, fmt in REQUESTS.items():
        capsys.readouterr()
        with pytest.raises(SystemExit) as helped_exit:
            main(["plan", policy, "--help"])
        assert helped_exit.value.code == 0
        helped = capsys.readouterr().out
        assert json.dumps(fmt.example) in helped and fmt.doc in helped
        root = ["--root", gh200] if policy in ("place", "cpu-binding", "guest-pci") else []
        argv = ["plan", policy, "--request", "-", *root]

        def decide(request: object) -> tuple[int, str]:
            return memtopo_main(monkeypatch, argv, json.dumps(request))  # noqa: B023 (called in this iteration)

        # cpu-binding's example is complete: it is decided without discovery, whatever the root.
        rc, decided = decide(fmt.example)
        assert rc == 0, decided
        assert json.loads(decided)["policy"] == policy
        for name, _ in fmt.fields:
            _, answer = decide({**fmt.example, name: fmt.example.get(name)})
            assert f"'{name}'" not in answer or "unknown keys" not in answer, (policy, answer)
        _, misspelt = decide({**fmt.example, "zz_not_a_field": 1})
        assert "unknown keys ['zz_not_a_field']" in misspelt  # the check above can fail
