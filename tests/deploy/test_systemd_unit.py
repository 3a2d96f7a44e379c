"""systemd/memtopo-agent.service: systemd's own verifier and security analysis, the exact hardening
the unit documents (capabilities, writable paths, system calls), its agreement with agent.config,
and that the agent's native code runs with write+execute mappings refused (MemoryDenyWriteExecute)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

from memtopo.agent.config import DEFAULT_CONFIG_PATH, EXIT_CONFIG, AgentConfig
from tests.apply_fakes import machine, plan
from tests.fixtures import REPO

UNIT = REPO / "systemd" / "memtopo-agent.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")

# Measured with systemd 252: 3.1 ("OK"). The margin (0.4) absorbs a newer systemd scoring an extra
# setting; more than that means a hardening line was dropped or a capability added. What remains is
# inherent: root, host network, devices, cgroupfs and /proc/irq writes, SYS_PTRACE/SYS_NICE.
MAX_EXPOSURE = 3.5

CAPABILITIES = {"CAP_SYS_NICE", "CAP_SYS_PTRACE", "CAP_CHOWN"}
READ_WRITE_PATHS = {"/sys/fs/cgroup", "/proc/irq"}
# What the apply engine calls (apply/host.py) and grpc/Python need.
NEEDED_SYSCALLS = {"sched_setaffinity", "sched_getaffinity", "migrate_pages", "set_mempolicy", "get_mempolicy",
                   "mbind", "move_pages", "socket", "bind", "connect", "sendmsg", "recvmsg", "epoll_wait",
                   "clone3", "execve", "mmap", "mprotect", "openat", "mkdir", "rmdir", "chown", "fchmodat"}
# CAP_SYS_PTRACE is for permission checks only: nothing that reads, writes or steals from another
# process may be allowed.
FORBIDDEN_SYSCALLS = {"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "init_module",
                      "finit_module", "mount", "umount2", "reboot", "kexec_load", "settimeofday", "swapon",
                      "bpf", "perf_event_open", "ioperm", "iopl"}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections → key → every value in order (systemd settings may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"setting outside a section: {line!r}"
        assert not line.endswith("\\"), "continuation lines are not used in this unit"
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@cache
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def service(key: str) -> list[str]:
    return unit()["Service"].get(key, [])


def words(key: str) -> list[str]:
    return [w for value in service(key) for w in value.split()]


def verifiable_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this checkout's memtopo: `systemd-analyze verify` checks
    that the executable exists, and /usr/local/bin/memtopo is only there on an installed host."""
    exe = Path(sys.executable).parent / "memtopo"
    if not exe.exists():
        pytest.skip(f"no memtopo console script beside {sys.executable}")
    text = UNIT.read_text()
    assert text.count("ExecStart=/usr/local/bin/memtopo ") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("ExecStart=/usr/local/bin/memtopo ", f"ExecStart={exe} "))
    return copy


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=120, check=False)


# --- systemd's own checks ----------------------------------------------------------------------


@needs_analyze
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    copy = verifiable_copy(tmp_path)
    res = analyze("verify", "--man=no", str(copy))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    # verify exits 0 on unknown keys and bad values too; it only prints them.
    assert UNIT.name not in out and "memtopo" not in out, out


@needs_analyze
def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    # The clean result above means something: the same run reports a misspelt setting.
    copy = verifiable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    out = analyze("verify", "--man=no", str(copy))
    assert "Unknown key 'NoNewPrivilege'" in out.stdout + out.stderr


@needs_analyze
def test_security_exposure_is_within_the_measured_threshold(tmp_path: Path) -> None:
    res = analyze("security", "--offline=yes", str(verifiable_copy(tmp_path)))
    assert res.returncode == 0, res.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", res.stdout)
    assert m, res.stdout[-2000:]
    exposure = float(m.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{res.stdout}"
    passed = {line.split()[1] for line in res.stdout.splitlines() if line.startswith("✓")}
    for check in ("NoNewPrivileges=", "ProtectSystem=", "MemoryDenyWriteExecute=", "PrivateTmp=",
                  "ProtectHome=", "ProtectKernelModules=", "ProtectKernelLogs=", "ProtectClock=",
                  "ProtectHostname=", "LockPersonality=", "RestrictRealtime=", "RestrictSUIDSGID=",
                  "SystemCallArchitectures=", "CapabilityBoundingSet=~CAP_SYS_ADMIN",
                  "CapabilityBoundingSet=~CAP_(DAC_*|FOWNER|IPC_OWNER)", "CapabilityBoundingSet=~CAP_KILL",
                  "CapabilityBoundingSet=~CAP_NET_ADMIN", "SystemCallFilter=~@debug", "SystemCallFilter=~@mount",
                  "SystemCallFilter=~@module", "RestrictNamespaces=~user", "NotifyAccess=", "UMask="):
        assert check in passed, check


@needs_analyze
def test_exposure_check_would_notice_a_dropped_hardening_line(tmp_path: Path) -> None:
    copy = verifiable_copy(tmp_path)
    text = copy.read_text()
    for line in ("CapabilityBoundingSet=", "SystemCallFilter=", "NoNewPrivileges=", "ProtectSystem="):
        text = "\n".join(x for x in text.splitlines() if not x.startswith(line))
    copy.write_text(text)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", analyze("security", "--offline=yes", str(copy)).stdout)
    assert m and float(m.group(1)) > MAX_EXPOSURE


@cache
def expand_syscalls(name: str) -> frozenset[str]:
    """A syscall or @group as the set of syscalls it names (groups nest)."""
    if not name.startswith("@"):
        return frozenset({name})
    res = analyze("syscall-filter", name)
    assert res.returncode == 0, res.stderr
    out: set[str] = set()
    for line in res.stdout.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            out |= expand_syscalls(item)
    return frozenset(out)


@needs_analyze
def test_system_call_filter_allows_apply_and_denies_reaching_into_processes() -> None:
    allowed: set[str] = set()
    denied: set[str] = set()
    for value in service("SystemCallFilter"):
        target = denied if value.startswith("~") else allowed
        for name in value.removeprefix("~").split():
            target |= expand_syscalls(name)
    effective = allowed - denied
    assert effective >= NEEDED_SYSCALLS, NEEDED_SYSCALLS - effective
    assert not FORBIDDEN_SYSCALLS & effective, FORBIDDEN_SYSCALLS & effective
    # The explicit apply line is redundant today; it must stay a subset of @system-service so that it
    # documents rather than widens.
    assert expand_syscalls("@resources") <= expand_syscalls("@system-service")
    assert service("SystemCallErrorNumber") == ["EPERM"]


# --- the unit says exactly what it documents -------------------------------------------------


def test_capabilities_are_exactly_the_documented_ones() -> None:
    assert set(words("CapabilityBoundingSet")) == CAPABILITIES
    assert service("AmbientCapabilities") == [""]
    assert "User" not in unit()["Service"]  # root: irqbalance's socket and the root-owned files
    # Each kept capability has its reason in the unit's comments.
    text = UNIT.read_text()
    for cap in CAPABILITIES:
        assert re.search(rf"^#\s+{cap}\s+\S", text, re.MULTILINE), cap


def test_writable_paths_are_exactly_what_apply_writes() -> None:
    assert set(words("ReadWritePaths")) == READ_WRITE_PATHS
    assert service("ProtectSystem") == ["strict"]
    assert service("ReadOnlyPaths") == ["/"]  # /proc, /sys and /dev too, not only the OS tree
    # Both would mount the paths above read-only, winning over ReadWritePaths= on the same path.
    assert service("ProtectControlGroups") == ["no"]
    assert "ProtectKernelTunables" not in unit()["Service"]
    assert not {"InaccessiblePaths", "BindPaths", "TemporaryFileSystem"} & set(unit()["Service"])


@pytest.mark.parametrize("cgroup_version", [1, 2])
def test_apply_engine_writes_only_below_the_writable_paths(tmp_path: Path, cgroup_version: int) -> None:
    # The engine confines its writes to prefixes it opens at run time (apply/host.py HostFiles);
    # on a fake host with either cgroup layout they must all lie below the unit's ReadWritePaths.
    m = machine(tmp_path, cgroup_version=cgroup_version)
    m.engine().apply(plan("probe"), dry_run=True)
    opened = ["/" + p for p in m.files.writable]
    assert opened
    for prefix in opened:
        assert any(prefix == w or prefix.startswith(w + "/") for w in READ_WRITE_PATHS), prefix
    # The state directory is not among them: the unit provides it through StateDirectory=.
    assert all(not p.startswith("/var") for p in opened)


EXPECTED_SETTINGS = {
    "Type": ["notify"], "NotifyAccess": ["main"], "WatchdogSec": ["30"], "Restart": ["on-failure"],
    "KillSignal": ["SIGTERM"], "StateDirectory": ["memtopo"], "RuntimeDirectory": ["memtopo"],
    "RuntimeDirectoryMode": ["0750"], "ConfigurationDirectory": ["memtopo"], "NoNewPrivileges": ["yes"],
    "PrivateTmp": ["yes"], "ProtectHome": ["yes"], "ProtectKernelModules": ["yes"], "ProtectKernelLogs": ["yes"],
    "ProtectClock": ["yes"], "ProtectHostname": ["yes"], "RestrictNamespaces": ["yes"], "LockPersonality": ["yes"],
    "MemoryDenyWriteExecute": ["yes"], "RestrictRealtime": ["yes"], "RestrictSUIDSGID": ["yes"],
    "SystemCallArchitectures": ["native"], "DevicePolicy": ["closed"],
}


@pytest.mark.parametrize(("key", "values"), sorted(EXPECTED_SETTINGS.items()))
def test_required_settings(key: str, values: list[str]) -> None:
    assert service(key) == values


def test_timeouts_and_address_families() -> None:
    assert set(words("RestrictAddressFamilies")) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert service("RestartSec") and service("TimeoutStopSec")
    # The watchdog fires well after the agent's ping interval (half of it) and before a stop timeout
    # would matter; a stop must have time to roll back an in-flight plan.
    assert int(service("TimeoutStopSec")[0]) >= 10


def test_devices_are_closed_except_vendor_groups() -> None:
    allowed = [v.split() for v in service("DeviceAllow")]
    assert ["char-nvidia*", "rw"] in allowed
    for spec, access in allowed:
        assert spec.startswith("char-"), spec  # groups: silent when absent, unlike paths
        assert access == "rw"  # never m (mknod)


def test_unit_agrees_with_the_config_defaults() -> None:
    defaults = AgentConfig()
    (exec_start,) = service("ExecStart")
    assert exec_start == f"/usr/local/bin/memtopo serve --config {DEFAULT_CONFIG_PATH}"
    assert DEFAULT_CONFIG_PATH.parent == Path("/etc") / service("ConfigurationDirectory")[0]
    assert Path(defaults.listen.socket).parent == Path("/run") / service("RuntimeDirectory")[0]
    assert Path(defaults.state_dir) == Path("/var/lib") / service("StateDirectory")[0]
    assert service("RestartPreventExitStatus") == [str(EXIT_CONFIG)]
    assert unit()["Install"]["WantedBy"] == ["multi-user.target"]


# --- MemoryDenyWriteExecute: the agent's native code under the kernel's equivalent ------------

_MDWE_PROBE = textwrap.dedent("""
    import asyncio, ctypes, mmap, sys, tempfile
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        print("NO-MDWE", ctypes.get_errno()); sys.exit(0)
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        sys.exit("a write+execute mapping was allowed: MDWE is not in force")
    except OSError:
        pass
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from memtopo.apply.host import LinuxKernel
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext
    live = discover(ProbeContext.live())
    fixture = discover(ProbeContext.at_root(sys.argv[1]))
    LinuxKernel().get_affinities([0])  # the ctypes syscall path of apply
    async def serve() -> int:
        d = tempfile.mkdtemp()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"unix:{d}/agent.sock")
        await server.start()
        async with grpc.aio.insecure_channel(f"unix:{d}/agent.sock") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        await server.stop(None)
        return reply.status
    print("OK", len(live.numa_nodes), len(fixture.numa_nodes), asyncio.run(serve()))
""")


def test_agent_runs_with_write_execute_mappings_refused() -> None:
    from tests.fixtures import hwloc_root

    root = hwloc_root("16amd64-8n2c-cpusets")
    res = subprocess.run([sys.executable, "-c", _MDWE_PROBE, str(root)], capture_output=True, text=True,
                         timeout=300, cwd=REPO, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    if res.stdout.startswith("NO-MDWE"):
        pytest.skip(f"kernel without PR_SET_MDWE (Linux < 6.3): {res.stdout.strip()}")
    ok, live_nodes, fixture_nodes, status = res.stdout.split()
    assert ok == "OK" and int(live_nodes) >= 1
    assert int(fixture_nodes) == 8  # the fixture's 8 NUMA nodes: hwloc and sysfs really ran
    assert int(status) == 1  # SERVING
