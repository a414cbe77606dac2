"""Why /proc will not show another process: what is actually missing, not generic advice.

OS layer: reads /proc/self/status, /proc/PID/status, /proc/self/mountinfo and
/proc/self/uid_map. The kernel's rules (ptrace_may_access, PTRACE_MODE_READ_FSCREDS;
proc_fd_permission; hidepid):

- /proc/PID/maps and the targets of /proc/PID/fd/N need ptrace read access: allowed when
  the process's real, effective and saved uid (and gid) all equal yours, it is dumpable
  and its permitted capabilities are a subset of your effective ones (the commoncap
  rule: a root process that dropped CAP_SYS_PTRACE cannot read a full-capability root
  process), otherwise only with CAP_SYS_PTRACE (in its user namespace). Yama's
  ptrace_scope governs attaching only, never this read access: it is not a reason.
- listing /proc/PID/fd is a plain permission check on a 0500 directory owned by the
  process's uid (root, when the process is not dumpable): another uid needs
  CAP_DAC_READ_SEARCH.
- /proc mounted with hidepid=invisible (2) hides other users' processes entirely (they
  look absent), hidepid=noaccess (1) denies their entries; a member of the mount's `gid=`
  or a holder of ptrace read access is exempt.
- a PID namespace: /proc shows only that namespace's processes, by its own pids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

CAP_DAC_OVERRIDE: Final = 1
CAP_DAC_READ_SEARCH: Final = 2
CAP_SYS_PTRACE: Final = 19


@dataclass(frozen=True, slots=True)
class Ids:
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]


def _status(pid: int | str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key] = value.strip()
    except OSError:
        pass
    return out


def _ids(status: dict[str, str]) -> Ids | None:
    try:
        uids = tuple(int(v) for v in status["Uid"].split())
        gids = tuple(int(v) for v in status["Gid"].split())
    except (KeyError, ValueError):
        return None
    return Ids(uids, gids)


def own_capabilities() -> int:
    """This process's effective capability set, as a bit mask."""
    try:
        return int(_status("self")["CapEff"], 16)
    except (KeyError, ValueError):
        return 0


def _capabilities(pid: int) -> int:
    """The process's permitted capability set (0 if unreadable)."""
    try:
        return int(_status(pid)["CapPrm"], 16)
    except (KeyError, ValueError):
        return 0


# capability(7) numbering, for messages
_CAP_NAMES: Final = (
    "chown",
    "dac_override",
    "dac_read_search",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "linux_immutable",
    "net_bind_service",
    "net_broadcast",
    "net_admin",
    "net_raw",
    "ipc_lock",
    "ipc_owner",
    "sys_module",
    "sys_rawio",
    "sys_chroot",
    "sys_ptrace",
    "sys_pacct",
    "sys_admin",
    "sys_boot",
    "sys_nice",
    "sys_resource",
    "sys_time",
    "sys_tty_config",
    "mknod",
    "lease",
    "audit_write",
    "audit_control",
    "setfcap",
    "mac_override",
    "mac_admin",
    "syslog",
    "wake_alarm",
    "block_suspend",
    "audit_read",
    "perfmon",
    "bpf",
    "checkpoint_restore",
)


def capability_names(mask: int) -> list[str]:
    return [
        f"CAP_{_CAP_NAMES[bit].upper()}" if bit < len(_CAP_NAMES) else f"capability {bit}"
        for bit in range(mask.bit_length())
        if mask >> bit & 1
    ]


def has_capability(cap: int, caps: int | None = None) -> bool:
    return bool((own_capabilities() if caps is None else caps) >> cap & 1)


def proc_hidepid() -> tuple[str, str | None]:
    """(hidepid mode, exempt gid) of the /proc mount this process sees: mode "off",
    "noaccess", "invisible" or "ptraceable"."""
    modes = {"0": "off", "1": "noaccess", "2": "invisible", "4": "ptraceable"}
    try:
        # lines at "\n" only: mountinfo escapes a mount point's \n, not its \r or \x0b
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode(errors="replace").split("\n")
    except OSError:
        return "off", None
    for line in reversed(lines):  # the last mount on /proc is the visible one
        fields = line.split(" ")  # spaces only (escaped in paths), not a name's \x85
        if len(fields) < 10 or fields[4] != "/proc" or "-" not in fields:
            continue
        sep = fields.index("-")
        if fields[sep + 1] != "proc":
            continue
        options = dict(o.partition("=")[::2] for o in fields[sep + 3].split(","))
        mode = options.get("hidepid", "off")
        return modes.get(mode, mode), options.get("gid")
    return "off", None


# the initial namespace's fixed inode (PROC_PID_INIT_INO): any other is a nested one
_INIT_PID_NAMESPACE: Final = "pid:[4026531836]"


def in_pid_namespace() -> bool:
    """Whether this process lives in a nested PID namespace (one that the host's
    processes are invisible from)."""
    try:
        return os.readlink("/proc/self/ns/pid") != _INIT_PID_NAMESPACE
    except OSError:
        return False


def pid_namespace_pids() -> tuple[int, ...]:
    """This process's pid in each PID namespace that the /proc mount can see, outermost
    first (NSpid; a namespace's own /proc shows only its own pid)."""
    return tuple(int(v) for v in _status("self").get("NSpid", "").split() if v.isdigit())


def in_user_namespace() -> bool:
    """Whether this process's user namespace maps fewer than all uids (not the initial)."""
    try:
        with open("/proc/self/uid_map", encoding="ascii") as f:
            lines = f.read().split("\n")
    except OSError:
        return False
    return [line.split() for line in lines if line.strip()] != [["0", "0", "4294967295"]]


def why_not_found(pid: int) -> str:
    """What, besides the process simply not existing, can make `pid` look absent."""
    hints = []
    hidepid, gid = proc_hidepid()
    if hidepid in ("invisible", "ptraceable") and not has_capability(CAP_SYS_PTRACE):
        exempt = f" (members of gid {gid} see them)" if gid else ""
        hints.append(
            f"/proc is mounted with hidepid={hidepid}: processes you may not trace are "
            f"hidden{exempt}; run as the process's uid, or with CAP_SYS_PTRACE"
        )
    nspids = pid_namespace_pids()
    if in_pid_namespace() or len(nspids) > 1:
        outer = f", {nspids[0]} outside" if len(nspids) > 1 else ""
        hints.append(
            f"this command runs in a PID namespace (its pid is {os.getpid()} here{outer}): "
            "/proc shows only that namespace's processes, by their pids in it; run it "
            "where the process is visible (on the host, or `nsenter --target HOSTPID "
            "--pid --mount`)"
        )
    return "; ".join(hints)


def why_denied(pid: int) -> str:
    """What this process lacks to read `pid`'s fds and mappings, as specifically as /proc
    lets us tell."""
    caps = own_capabilities()
    ptrace = has_capability(CAP_SYS_PTRACE, caps)
    dac = has_capability(CAP_DAC_READ_SEARCH, caps) or has_capability(CAP_DAC_OVERRIDE, caps)
    mine = _ids(_status("self"))
    theirs = _ids(_status(pid))
    reasons: list[str] = []
    if mine is None or theirs is None:
        hidepid, gid = proc_hidepid()
        if hidepid in ("noaccess", "invisible", "ptraceable"):
            exempt = f", unless in gid {gid}" if gid else ""
            reasons.append(
                f"/proc is mounted with hidepid={hidepid}: other users' process entries "
                f"are closed to you{exempt}"
            )
        reasons.append("its /proc/PID/status is unreadable too, so its uid is unknown")
        return "; ".join(reasons)
    me_uid, me_gid = mine.uids[3], mine.gids[3]  # the filesystem ids are what /proc checks
    same_ids = all(u == me_uid for u in theirs.uids[:3]) and all(
        g == me_gid for g in theirs.gids[:3]
    )
    if not same_ids:
        who = _describe_ids(theirs)
        needed = [] if ptrace else ["CAP_SYS_PTRACE"]
        if not dac:
            needed.append("CAP_DAC_READ_SEARCH (to list its fd directory)")
        if needed:
            return (
                f"it runs as {who} and you as uid {me_uid} gid {me_gid}; reading another "
                f"user's process needs {' and '.join(needed)}, which this process lacks: "
                f"run as uid {theirs.uids[1]}, or with those capabilities "
                "(sudo, or `--cap-add SYS_PTRACE` for a container)"
            )
    elif not ptrace:
        owner = _proc_owner(pid)
        extra = _capabilities(pid) & ~caps
        if extra:
            state = (
                "it runs as you but holds capabilities this process lacks "
                f"({', '.join(capability_names(extra))})"
            )
        elif owner is not None and owner != theirs.uids[1]:
            state = f"it is not dumpable (its /proc entries belong to uid {owner})"
        else:
            state = (
                "it runs as you, so it is not dumpable (prctl PR_SET_DUMPABLE 0, or it "
                "changed credentials) or lives in another user namespace"
            )
        return f"{state}; reading it then needs CAP_SYS_PTRACE, which this process lacks"
    # the ids and capabilities the kernel's rules ask for are there, and still denied
    held = "CAP_SYS_PTRACE" if ptrace else "its uid"
    causes = []
    if in_user_namespace():
        causes.append(
            "this command runs in a user namespace, and capabilities there do not reach "
            "a process of a parent namespace"
        )
    hidepid, _gid = proc_hidepid()
    if hidepid != "off":
        causes.append(f"/proc is mounted hidepid={hidepid}")
    causes.append(_security_modules())
    return f"this process has {held}, so the denial comes from elsewhere: " + "; or ".join(causes)


def _security_modules() -> str:
    """The security modules that can deny ptrace read access here (Yama only governs
    attaching, so it is never the cause)."""
    try:
        with open("/sys/kernel/security/lsm", encoding="ascii") as f:
            active = set(f.read().strip().split(","))
    except OSError:
        active = {"landlock", "apparmor", "selinux", "smack"}  # securityfs not mounted
    named = []
    if "landlock" in active:
        named.append(
            "a Landlock sandbox around this command (a sandboxed process may read only "
            "processes inside its own sandbox)"
        )
    names = {"apparmor": "AppArmor", "selinux": "SELinux", "smack": "Smack"}
    policies = [name for module, name in names.items() if module in active]
    if policies:
        named.append(f"{' or '.join(policies)} policy")
    return "a security module: " + (" or ".join(named) or "one this kernel runs")


def _describe_ids(ids: Ids) -> str:
    uids = sorted(set(ids.uids[:3]))
    if len(uids) == 1:
        return f"uid {uids[0]} gid {ids.gids[1]}"
    real, eff, saved = ids.uids[:3]
    return f"uid {real} (effective {eff}, saved {saved}) gid {ids.gids[1]}"


def _proc_owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
