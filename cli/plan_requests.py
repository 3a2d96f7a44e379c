"""The request of each ``memtopo plan`` policy as its ``--help`` shows it: the fields, an example that
the policy decides as it stands, and the page with every rule. The example is data, so the tests run
it through the command and check each field named here against what the policy's parser accepts."""

from __future__ import annotations

from typing import Any, Final, NamedTuple

EPILOG_COLUMNS: Final = 96


class RequestFormat(NamedTuple):
    """A NamedTuple, not a dataclass: the parser, and so every command's start, builds these."""

    fields: tuple[tuple[str, str], ...]  # (name, what it holds)
    example: dict[str, Any]
    doc: str
    options: str = ""  # what the example's command line adds after --request -

    def epilog(self, policy: str) -> str:
        import json
        import textwrap

        width = max(len(name) for name, _ in self.fields)
        indent = " " * (width + 4)
        rows = "\n".join(textwrap.fill(meaning, EPILOG_COLUMNS, initial_indent=f"  {name:<{width}}  ",
                                       subsequent_indent=indent) for name, meaning in self.fields)
        command = f"memtopo plan {policy} --request -{' ' + self.options if self.options else ''}"
        return (f"request: a JSON object (FILE, or - for stdin); unknown keys are refused.\n{rows}\n\n"
                f"example:\n  echo '{json.dumps(self.example)}' \\\n    | {command}\n\n"
                f"Every rule: {self.doc}; the command's output and exit status: docs/planner-cli.md.")


REQUESTS: Final[dict[str, RequestFormat]] = {
    "cpu-binding": RequestFormat(
        fields=(
            ("device_type", "A2, A3, 310P, a SoC name (ascend910b3) or an npu-smi chip name (Ascend910)"),
            ("allowed_cpus", 'cpulist the process may use ("144-191")'),
            ("running_npus", "logical NPU ids with a process: a list of integers, at least one"),
            ("total_logic_npus", "optional: the number of logical NPUs on the host"),
            ("topo_affinity", 'optional: {"<NPU id>": "<cpulist>"} (npu-smi info -t topo)'),
            ("numa_cpus", 'optional: {"<node>": "<cpulist>"}; absent facts come from discovery (--root, '
                          "else this host)"),
        ),
        example={"device_type": "A3", "allowed_cpus": "0-23", "total_logic_npus": 4, "running_npus": [0, 1, 2, 3]},
        doc="docs/planner-cpu-binding.md"),
    "place": RequestFormat(
        fields=(
            ("cpus", "CPUs for the allocation, at least 1"),
            ("gpus", "optional: GPUs (default 0)"),
            ("memory_gb", "optional: GiB of memory (default 0; may be fractional)"),
            ("workload", "optional: gpu-heavy, cpu-heavy or default"),
            ("constraints", "optional: {memory_policy: local|interleave|preferred|bind, prefer_same_numa, "
                            "require_unified_memory, prefer_local_memory, allow_cxl_memory (true/false)}"),
            ("topology", "optional: the node as `memtopo topo --format json` prints it (default: discovery)"),
        ),
        example={"cpus": 8, "gpus": 1, "memory_gb": 16, "workload": "gpu-heavy",
                 "constraints": {"prefer_same_numa": True}},
        doc="docs/planner-guest-pci-place.md", options="[--root CAPTURE]"),
    "guest-pci": RequestFormat(
        fields=(
            ("devices", 'list of {"bdf": "DDDD:BB:SS.F", "numa_node": N (-1: none; absent: from discovery), '
                        '"mdev": UUID?, "guest_address": {bus, slot, …}?}'),
            ("strict", "optional: every fallback is an error (default false)"),
            ("highest_controller_index", "optional: the domain's highest controller index (default 0)"),
            ("numa_mapping", 'optional: {"<host node>": <guest cell>}, or'),
            ("guest_numa", "optional: {cells, vcpupins, memnodes, host_node_cpus}, from which it is derived"),
        ),
        example={"devices": [{"bdf": "0000:03:00.0", "numa_node": 0}, {"bdf": "0000:3b:00.2", "numa_node": 1}],
                 "numa_mapping": {"0": 0, "1": 1}},
        doc="docs/planner-guest-pci-place.md"),
    "hccs": RequestFormat(
        fields=(
            ("request", "NPUs for the job: 1, 2, 4, 8 or 8·N (N pods of 8)"),
            ("nodes", 'list of {"name", "available": [free NPU ids 0-7], "capacity": healthy NPUs?}'),
        ),
        example={"request": 2, "nodes": [{"name": "a", "available": [4, 5, 0], "capacity": 8},
                                         {"name": "b", "available": [0, 1, 2, 4, 5, 6]}]},
        doc="docs/planner-hccs-xpu.md"),
    "xpu": RequestFormat(
        fields=(
            ("request", "XPUs for the task: 1, 2, 4 or 8"),
            ("nodes", 'list of {"name", and "used": [XPU ids 0-7] or "occupancy": "00000111" (bit i from the '
                      'right = XPU i)}'),
            ("cross_half_fallback", "optional: may a task span the two NUMA halves (default false)"),
        ),
        example={"request": 1, "nodes": [{"name": "a", "occupancy": "00000111"}, {"name": "b", "used": [4, 0]}]},
        doc="docs/planner-hccs-xpu.md"),
}
