"""`hostpool doctor`: what this host supports, and whether a request can be met."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hostpool.base.units import format_size, parse_size_with_unit
from hostpool.cli.command import Subcommand
from hostpool.cli.exitcodes import INVALID, NOT_NOW, OK
from hostpool.errors import InvalidRequestError


def _size(
    group: argparse._ActionsContainer, flag: str, default: str, text: str, unit: str = "GiB"
) -> None:
    """A flag that takes a byte size with its unit (a bare 48 is a usage error, exit 2,
    offering 48`unit`): none of doctor's sizes is ever a handful of bytes."""

    def size(value: str) -> int:
        try:
            return parse_size_with_unit(value, what=flag, unit=unit)
        except InvalidRequestError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from exc

    group.add_argument(
        flag, type=size, default=default, metavar="SIZE", help=f"{text} (default {default})"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--hugepages",
        default="prefer",
        choices=("off", "prefer", "required"),
        help="what allocations would ask for, as the pool option: prefer (default: hugetlb "
        "if free, else THP or 4 KiB pages), off, or required (a check: exit 1 when too few "
        "hugepages of --hugepage-size are free)",
    )
    _size(p, "--hugepage-size", "2MB", "the hugetlb page size to check, e.g. 2MB or 1GB", "MB")
    _size(p, "--need", "0", "bytes a pool needs, e.g. 64GiB")
    k8s = p.add_argument_group(
        "Kubernetes",
        "--kubernetes: the pod resources the pools of --config FILE or of an engine command "
        "line (after --, or the --pod container's) need, as a strategic merge patch of a "
        "Deployment; with --pod, that pod spec judged against them, and with --check-host "
        "the limits of the node (or pod) it runs on, one verdict per line (exit 1 if one "
        "fails). This machine is judged only with --check-host",
    )
    k8s.add_argument("--kubernetes", action="store_true", help="size a pod (see above)")
    k8s.add_argument("--config", metavar="FILE", help="a hostpool serve config's pools")
    memory = "the engine's own memory besides its pools, added to the memory limit"
    _size(k8s, "--engine-memory", "0", memory)
    _size(k8s, "--shm-extra", "0", "room in /dev/shm for the engine's other files (NCCL...)")
    k8s.add_argument(
        "--container",
        help="the engine container's name (required unless --pod has only one container)",
    )
    k8s.add_argument(
        "--pod",
        metavar="FILE",
        help="a manifest (Deployment, StatefulSet, DaemonSet, Job, Pod): its pod spec is "
        "judged, and the engine's command line is its container's unless one follows --",
    )
    k8s.add_argument(
        "--check-host",
        action="store_true",
        help="also judge the node (or pod) this runs on: /dev/shm, cgroup memory, free "
        "hugepages, ulimit -l, vm.max_map_count",
    )
    k8s.add_argument(
        "engine_command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="a vLLM or sglang command line",
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _count(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def _bytes(value: int | None) -> str:
    return "unlimited" if value is None else format_size(value)


def _cgroup(memory: dict[str, Any] | None) -> str:
    if not memory:
        return "no limit"
    return (
        f"limit {format_size(memory['limit_bytes'])}, {format_size(memory['usage_bytes'])} "
        f"used ({memory['source']})"
    )


def _reporting(order: int | None) -> str:
    return "off" if order is None else f"from order {order} ({format_size(4096 << order)})"


def _thp(choice: dict[str, Any]) -> str:
    """What hugepages="prefer" does for this kind once hugetlb is out, and why."""
    if choice["advise"]:
        return f"MADV_HUGEPAGE ({choice['why']})"
    pages = "4 KiB pages, MADV_NOHUGEPAGE" if choice["avoid"] else "4 KiB pages"
    return f"{pages}, reason {choice['reason']}: {choice['why']}"


def run(args: argparse.Namespace) -> int:
    from hostpool.core.doctor import facts, plan

    command = args.engine_command[1:] if args.engine_command[:1] == ["--"] else args.engine_command
    if args.kubernetes:
        return _kubernetes(args, command)
    if args.config or command:
        print("hostpool doctor: --config and a command line go with --kubernetes", file=sys.stderr)
        return INVALID
    need: int = args.need
    report = {"host": facts(), "plan": plan(args.hugepages, args.hugepage_size, need)}
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0 if report["plan"]["ok"] else 1
    host, chosen = report["host"], report["plan"]
    lines = [
        f"kernel               {host['kernel']}",
        f"memfd                {_yes(host['memfd'])} (MFD_NOEXEC_SEAL "
        f"{_yes(host['mfd_noexec_seal'])}, sealing {_yes(host['sealing'])})",
        f"MADV_POPULATE_WRITE  {_yes(host['madv_populate_write'])}",
        f"memory               {format_size(host['memory']['available_bytes'])} available of "
        f"{format_size(host['memory']['total_bytes'])}",
    ]
    for label, hp in host["hugepages"].items():
        lines.append(
            f"hugepages {label:<10} total {hp['total']}, free {hp['free']}, "
            f"reserved {hp['reserved']}"
        )
    lines += [
        f"shmem THP            {host['thp']['shmem_enabled']}",
        f"anonymous THP        {host['thp']['enabled']}, defrag {host['thp']['defrag']}, "
        f"{format_size(host['thp']['free_hugepage_bytes'])} in free 2 MiB blocks, page "
        f"reporting {_reporting(host['thp']['reporting_order'])}",
        f"/dev/shm             {format_size(host['dev_shm']['free_bytes'])} free of "
        f"{format_size(host['dev_shm']['size_bytes'])}",
        f"RLIMIT_NOFILE        {_count(host['rlimits']['nofile']['soft'])} (hard "
        f"{_count(host['rlimits']['nofile']['hard'])})",
        f"RLIMIT_MEMLOCK       {_bytes(host['rlimits']['memlock']['soft'])} (hard "
        f"{_bytes(host['rlimits']['memlock']['hard'])})",
        f"cgroup memory        {_cgroup(host['cgroup_memory'])}",
        f"CUDA                 {_yes(host['cuda'])}",
        f"auto would choose    {chosen['backend']}, populate {chosen['populate']}, page "
        f"{format_size(chosen['page_size']) if 'page_size' in chosen else '-'}"
        + (f", fallbacks {', '.join(chosen['fallbacks'])}" if chosen.get("fallbacks") else ""),
    ]
    for kind, choice in chosen["thp_choice"].items():
        lines.append(f"THP for {kind:<13}{_thp(choice)}")
    lines += [f"PROBLEM: {p}" for p in chosen["problems"]]
    if chosen["ok"] and (need or args.hugepages == "required"):  # a check: say it passed
        lines.append(
            f"OK: {format_size(need)} with hugepages {args.hugepages} fits this host now"
            if need
            else f"OK: {format_size(args.hugepage_size)} hugepages are available (hugepages "
            "required)"
        )
    print("\n".join(lines))
    return 0 if chosen["ok"] else 1


def _kubernetes(args: argparse.Namespace, command: list[str]) -> int:
    import yaml

    from hostpool.core import enginecmd, podplan

    pod = podplan.load_pod(args.pod) if args.pod else None
    container = podplan.pod_container(pod, args.container)  # ConfigError: exit 2
    if pod is not None and not command and not args.config:
        (spec,) = [c for c in pod["containers"] if c.get("name") == container]
        command = [str(w) for w in (spec.get("command") or []) + (spec.get("args") or [])]
    if bool(args.config) == bool(command):
        print(
            "hostpool doctor: --kubernetes sizes either --config FILE or an engine command "
            "line (after --, or --pod's container's), one of them",
            file=sys.stderr,
        )
        return INVALID
    if args.config:
        from hostpool.serve.config import from_file

        needs = [pool.need() for pool in from_file(args.config).pools]
    else:
        needs = enginecmd.needs_from_command(command)
    engine: int = args.engine_memory
    extra: int = args.shm_extra
    patch = podplan.pod_resources(needs, engine_memory=engine, shm_extra=extra, container=container)
    verdicts = []
    if pod is not None:
        verdicts += podplan.pod_checks(pod, container, needs, engine_memory=engine, shm_extra=extra)
    if args.check_host:
        verdicts += podplan.node_checks(needs, engine_memory=engine, shm_extra=extra)
    ok = all(v.ok for v in verdicts)
    if args.json:
        print(json.dumps(podplan.as_json(needs, patch, verdicts), indent=2, sort_keys=True))
        return OK if ok else NOT_NOW
    # stdout stays a valid patch: what it was sized from and the verdicts are comments
    lines = [
        f"# {n.name}: {format_size(n.size_bytes)} {n.backing}"
        + (f", hugepages {n.hugepages} {format_size(n.hugepage_size)}" if n.hugetlb else "")
        + (", pinned" if n.pinned else "")
        + f" ({n.source})"
        for n in needs
    ]
    lines.append(
        f"# RLIMIT_MEMLOCK >= {format_size(podplan.pinned_bytes(needs))}: no pod field sets it "
        "(the container runtime's, e.g. LimitMEMLOCK= in containerd's unit)"
    )
    if not engine:
        lines.append("# memory counts the pools only: add the engine's own with --engine-memory")
    print("\n".join(lines))
    print(yaml.safe_dump(patch, sort_keys=False), end="")
    print("\n".join(f"# {v.line()}" for v in verdicts))
    return OK if ok else NOT_NOW


COMMAND = Subcommand(
    name="doctor",
    help="report what this host supports (exit 1 if --need fails)",
    description=(
        "Report what this host offers hostpool: kernel, memfd and sealing, "
        "MADV_POPULATE_WRITE, memory, hugepages per size, THP, /dev/shm, rlimits, the cgroup "
        "limit, CUDA, and what allocations with --hugepages/--hugepage-size would get. With "
        "--need SIZE (or --hugepages required) it is a check: exit 1 when this host cannot "
        "hold it now, naming each problem. With --kubernetes it sizes a pod instead: the "
        "resources the pools of a serve config or an engine command line need, and this "
        "node's limits against them."
    ),
    add_arguments=add_arguments,
    run=run,
)
