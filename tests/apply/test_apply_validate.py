"""Invalid and hostile plans: each is refused with a reason naming the action, and the host (fake
root + fake kernel) is left exactly as it was, state directory included."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.apply.errors import PlanFormatError
from memtopo.apply.planio import load_plan
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import (
    SELF_PID,
    FakeMachine,
    cpuset,
    irq,
    machine,
    mempolicy,
    migrate,
    plan,
    threads,
)
from tests.strategies import json_like

P = planpb.PlanResult
MP = planpb.MemoryPolicy


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeMachine]:
    m = machine(tmp_path_factory.mktemp("hostile"))
    # A cgroup "inside" the prefix that is a symlink out of the cgroup mount.
    (m.root / "outside").mkdir()
    os.symlink("../../../../../outside", m.root / "sys/fs/cgroup/cpuset/memtopo/escape")
    yield m


def _json(p: planpb.BindingPlan) -> str:
    return json_format.MessageToJson(p, preserving_proto_field_name=True)


def _bare(aid: str) -> planpb.PlanAction:
    return planpb.PlanAction(id=aid, required=True)


def _unset_selector() -> planpb.BindingPlan:
    a = _bare("t")
    a.thread_affinity.pid = 100
    a.thread_affinity.cpus.append(0)
    return plan("p", a)


def _all_false() -> planpb.BindingPlan:
    a = threads("t", 100, [0], all=True)
    a.thread_affinity.threads.all = False
    return plan("p", a)


def _mode(mode: int) -> planpb.BindingPlan:
    return plan("p", mempolicy("m", 100, [0], mode=mode))


# (name, plan JSON text, expected reason fragment, action id the reason must start with)
Case = tuple[str, Callable[[], str], str, str]
CASES: list[Case] = [
    ("empty plan", lambda: _json(plan("p")), "the plan has no actions", "plan"),
    ("empty plan id", lambda: _json(plan("", threads("t", 100, [0], all=True))), "plan_id is empty", "plan"),
    ("plan id too long", lambda: _json(plan("x" * 500, threads("t", 100, [0], all=True))), "longer than 128", "plan"),
    ("control chars in plan id", lambda: _json(plan("p\n1", threads("t", 100, [0], all=True))),
     "control characters", "plan"),
    ("stale topology fingerprint",
     lambda: _json(planpb.BindingPlan(plan_id="p", topology_fingerprint="0" * 64,
                                      actions=[threads("t", 100, [0], all=True)])), "re-plan", "plan"),
    ("unknown CPU", lambda: _json(plan("p", threads("t", 100, [99], all=True))), "CPU 99 not online", "t"),
    ("offline CPU", lambda: _json(plan("p", threads("t", 100, [8], all=True))), "CPU 8 not online", "t"),
    ("CPU id beyond any kernel", lambda: _json(plan("p", threads("t", 100, [70000], all=True))),
     "CPU 70000 does not exist", "t"),
    ("huge CPU list", lambda: _json(plan("p", threads("t", 100, range(100_000), all=True))),
     "more than any machine", "t"),
    ("repeated CPU ids", lambda: _json(plan("p", threads("t", 100, [1, 1], all=True))), "CPU ids repeat", "t"),
    ("empty CPU set", lambda: _json(plan("p", threads("t", 100, [], all=True))), "empty CPU set", "t"),
    ("offline node", lambda: _json(plan("p", cpuset("c", "memtopo/job", mems=[3]))), "node 3 is not online", "c"),
    ("unknown node", lambda: _json(plan("p", cpuset("c", "memtopo/job", mems=[9]))), "node 9 does not exist", "c"),
    ("node without memory", lambda: _json(plan("p", cpuset("c", "memtopo/job", mems=[2]))),
     "node 2 has no memory", "c"),
    ("pid 1", lambda: _json(plan("p", threads("t", 1, [0], all=True))), "pid 1 (init) is refused", "t"),
    ("kernel thread", lambda: _json(plan("p", threads("t", 2, [0], all=True))), "is a kernel thread", "t"),
    ("the agent itself", lambda: _json(plan("p", threads("t", SELF_PID, [0], all=True))), "the agent itself", "t"),
    ("a thread of the agent", lambda: _json(plan("p", migrate("m", SELF_PID + 1, [0], [1]))),
     "thread of the agent itself", "m"),
    ("pid 0", lambda: _json(plan("p", threads("t", 0, [0], all=True))), "0 is not a process id", "t"),
    ("negative pid", lambda: _json(plan("p", migrate("m", -5, [0], [1]))), "-5 is not a process id", "m"),
    ("missing process", lambda: _json(plan("p", threads("t", 99999, [0], all=True))),
     "process 99999 does not exist", "t"),
    ("zombie", lambda: _json(plan("p", threads("t", 77, [0], all=True))), "has exited", "t"),
    ("../../ cgroup path", lambda: _json(plan("p", cpuset("c", "memtopo/../../etc", cpus=[0]))), "'..'", "c"),
    ("absolute ../ cgroup path", lambda: _json(plan("p", cpuset("c", "/memtopo/../../x", cpus=[0], create=True))),
     "'..'", "c"),
    ("cgroup outside the prefixes", lambda: _json(plan("p", cpuset("c", "kubepods/pod1", cpus=[0], create=True))),
     "outside the configured cgroup prefixes", "c"),
    ("prefix look-alike", lambda: _json(plan("p", cpuset("c", "memtopo-evil/x", cpus=[0], create=True))),
     "outside the configured cgroup prefixes", "c"),
    ("symlinked cgroup escaping", lambda: _json(plan("p", cpuset("c", "memtopo/escape/x", cpus=[0], create=True))),
     "resolves outside", "c"),
    ("hierarchy root", lambda: _json(plan("p", cpuset("c", "/", cpus=[0]))), "hierarchy root", "c"),
    ("pid in the root cgroup", lambda: _json(plan("p", cpuset("c", pid=200, cpus=[0]))),
     "hierarchy root cannot be changed", "c"),
    ("duplicate action ids", lambda: _json(plan("p", threads("t", 100, [0], all=True), irq("t", [1], number=24))),
     "duplicate action id", "t"),
    ("contradictory actions",
     lambda: _json(plan("p", threads("a", 100, [0], all=True), threads("b", 100, [1], all=True))),
     "contradicts action a", "b"),
    ("duplicated action", lambda: _json(plan("p", irq("a", [1], number=24), irq("b", [1], name="ACPI"))),
     "duplicates action a", "b"),
    ("same IRQ, different CPUs", lambda: _json(plan("p", irq("a", [1], number=40), irq("b", [2], bdf="0000:3b:00.0"))),
     "contradicts action a", "b"),
    ("pid put in two cgroups",
     lambda: _json(plan("p", cpuset("a", "memtopo/x", cpus=[0], mems=[0], create=True, attach=[200]),
                        cpuset("b", "memtopo/y", cpus=[1], mems=[0], create=True, attach=[200]))), "puts pid 200", "b"),
    ("threads outside the plan's cpuset",
     lambda: _json(plan("p", cpuset("a", "memtopo/x", cpus=[0, 1], mems=[0], create=True, attach=[200]),
                        threads("b", 200, [5], all=True))), "outside cgroup", "b"),
    ("migration outside the plan's mems",
     lambda: _json(plan("p", mempolicy("a", 100, [0]), migrate("b", 100, [0], [1]))), "outside the mems", "b"),
    ("missing oneof", lambda: _json(plan("p", _bare("x"))), "no action set", "x"),
    ("missing thread selector", lambda: _json(_unset_selector()), "threads: no selector", "t"),
    ("all: false", lambda: _json(_all_false()), "selects nothing", "t"),
    ("tid of another process", lambda: _json(plan("p", threads("t", 100, [0], tids=[200]))),
     "not thread(s) of pid 100", "t"),
    ("unknown IRQ", lambda: _json(plan("p", irq("i", [0], number=999))), "IRQ 999 does not exist", "i"),
    ("absurd IRQ number", lambda: _json(plan("p", irq("i", [0], number=4_000_000_000))), "not an IRQ number", "i"),
    ("bad BDF", lambda: _json(plan("p", irq("i", [0], bdf="zz:00"))), "is not a PCI address", "i"),
    ("absent PCI device", lambda: _json(plan("p", irq("i", [0], bdf="0000:99:00.0"))), "does not exist", "i"),
    ("PCI device without MSI", lambda: _json(plan("p", irq("i", [0], bdf="0000:00:1f.0"))), "INTx IRQ 10", "i"),
    ("bad thread regex", lambda: _json(plan("p", threads("t", 100, [0], name="([a-"))), "bad regular expression", "t"),
    ("bad IRQ regex", lambda: _json(plan("p", irq("i", [0], name="*oops"))), "bad regular expression", "i"),
    ("overlong regex", lambda: _json(plan("p", irq("i", [0], name="a" * 300))), "longer than 256", "i"),
    ("regex matching no thread", lambda: _json(plan("p", threads("t", 100, [0], name="nope"))),
     "no thread of pid 100 matches", "t"),
    ("regex matching no IRQ", lambda: _json(plan("p", irq("i", [0], name="^nothing$"))), "no IRQ", "i"),
    ("partition on cgroup v1", lambda: _json(plan("p", cpuset("c", "memtopo/job", partition="root"))),
     "partition needs cgroup v2", "c"),
    ("bad partition value", lambda: _json(plan("p", cpuset("c", "memtopo/job", partition="exclusive"))),
     "not one of member, root, isolated", "c"),
    ("cgroup absent without create", lambda: _json(plan("p", cpuset("c", "memtopo/new", cpus=[0]))),
     "(set create)", "c"),
    ("create with pid_cgroup", lambda: _json(plan("p", cpuset("c", pid=100, cpus=[0], create=True))),
     "create applies to cgroup_path only", "c"),
    ("cpuset with nothing to do", lambda: _json(plan("p", cpuset("c", "memtopo/job"))), "nothing to change", "c"),
    ("interleave on a running process", lambda: _json(_mode(MP.MODE_INTERLEAVE)),
     "cannot be imposed on a running process", "m"),
    ("memory policy without a mode", lambda: _json(_mode(MP.MODE_UNSPECIFIED)), "mode is unset", "m"),
    ("migration to nowhere", lambda: _json(plan("p", migrate("m", 100, [0], []))), "empty node set", "m"),
    ("bad action id", lambda: _json(plan("p", threads("a b", 100, [0], all=True))), "action id", "action[0]"),
    ("too many actions", lambda: _json(plan("p", *[irq(f"i{n}", [0], number=24) for n in range(1100)])),
     "more than the limit of 1024", "plan"),
    # Text that is not a BindingPlan at all.
    ("not JSON", lambda: "{plan: yes", "not JSON", ""),
    ("not an object", lambda: "[1, 2]", "must be a JSON object", ""),
    ("wrong type for pid", lambda: json.dumps({"plan_id": "p", "actions": [
        {"id": "t", "thread_affinity": {"pid": "abc", "threads": {"all": True}, "cpus": [0]}}]}),
     "not a BindingPlan", ""),
    ("negative CPU id", lambda: json.dumps({"plan_id": "p", "actions": [
        {"id": "t", "thread_affinity": {"pid": 100, "threads": {"all": True}, "cpus": [-1]}}]}),
     "not a BindingPlan", ""),
    ("unknown field", lambda: json.dumps({"plan_id": "p", "actions": [{"id": "t", "shell": "rm -rf /"}]}),
     "not a BindingPlan", ""),
    ("two selectors of one oneof", lambda: json.dumps({"plan_id": "p", "actions": [
        {"id": "i", "irq_affinity": {"irq": 24, "pci_bdf": "0000:3b:00.0", "cpus": [0]}}]}),
     "not a BindingPlan", ""),
]


def _outcome(fake: FakeMachine, text: str) -> list[str]:
    try:
        p = load_plan(text)
    except PlanFormatError as exc:
        return [str(exc)]
    result = fake.engine().apply(p)
    assert result.state == P.STATE_REJECTED, result
    assert not result.actions
    return list(result.rejections)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "make", "reason", "aid"), CASES, ids=[c[0] for c in CASES])
def test_hostile_plan_is_rejected_and_host_unchanged(fake: FakeMachine, name: str, make: Callable[[], str],
                                                    reason: str, aid: str) -> None:
    before = fake.snapshot()
    calls_before = len(fake.kernel.mutations())
    writes_before = len(fake.files.writes)
    reasons = _outcome(fake, make())
    assert any(reason in r for r in reasons), reasons
    if aid:
        assert any(r.startswith(f"{aid}: ") and reason in r for r in reasons), reasons
    assert fake.snapshot() == before
    assert len(fake.kernel.mutations()) == calls_before
    assert len(fake.files.writes) == writes_before
    # A rejected plan is not stored: nothing under its id in the state directory.
    assert not list(Path(fake.state_dir).glob("*.result.json"))
    assert not list(Path(fake.state_dir).glob("*.journal.jsonl"))


def test_every_rejection_is_reported_not_only_the_first(fake: FakeMachine) -> None:
    p = plan("p", threads("a", 1, [0], all=True), irq("b", [99], number=24), cpuset("c", "../x", cpus=[0]))
    result = fake.engine().apply(p)
    assert result.state == P.STATE_REJECTED
    assert [r.split(":")[0] for r in result.rejections] == ["a", "b", "c"]


def test_optional_action_with_a_host_condition_is_skipped_not_rejected(fake: FakeMachine) -> None:
    # A missing IRQ on an optional action is a host condition (vLLM-Ascend binds IRQs only where found);
    # the same on a required one rejects the plan (above).
    result = fake.engine().apply(plan("p", irq("i", [0], number=999, required=False)), dry_run=True)
    assert result.state == P.STATE_DRY_RUN
    assert result.actions[0].status == planpb.ActionResult.STATUS_SKIPPED
    assert "IRQ 999 does not exist" in result.actions[0].reason


def test_structural_errors_reject_even_optional_actions(fake: FakeMachine) -> None:
    result = fake.engine().apply(plan("p", threads("t", 100, [99], all=True, required=False)))
    assert result.state == P.STATE_REJECTED
    assert "CPU 99" in result.rejections[0]


def test_config_allows_what_is_refused_by_default(fake: FakeMachine) -> None:
    p = plan("p", threads("t", 1, [0], all=True))
    assert fake.engine().apply(p, dry_run=True).state == P.STATE_REJECTED
    assert fake.engine(allow_init=True).apply(p, dry_run=True).state == P.STATE_DRY_RUN
    p2 = plan("p", cpuset("c", "kubepods/pod1", cpus=[0], create=True))
    assert fake.engine(cgroup_prefixes=("kubepods",)).apply(p2, dry_run=True).state == P.STATE_DRY_RUN


_json_values = json_like(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70) | st.text(max_size=20),
    st.sampled_from(["plan_id", "actions", "id", "required", "thread_affinity", "cpuset", "irq_affinity",
                     "pid", "cpus", "threads", "all", "tids", "name_pattern", "cgroup_path", "mems", "x"]),
    max_leaves=20, dict_size=5)


@settings(max_examples=300, deadline=None)
@given(_json_values)
def test_garbage_plan_json_is_a_typed_error_or_a_plan(value: object) -> None:
    try:
        p = load_plan(json.dumps(value))
    except PlanFormatError:
        return
    assert isinstance(p, planpb.BindingPlan)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_json_values)
def test_garbage_plans_that_parse_never_crash_validation(fake: FakeMachine, value: object) -> None:
    try:
        p = load_plan(json.dumps({"plan_id": "g", "actions": [value] if isinstance(value, dict) else value}))
    except PlanFormatError:
        return
    before = fake.snapshot()
    result = fake.engine().apply(p, dry_run=True)
    assert result.state in (P.STATE_REJECTED, P.STATE_DRY_RUN)
    assert fake.snapshot() == before
