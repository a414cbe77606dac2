"""A seccomp filter under which a process reads the host and cannot change it.

`read_only_filter()` loads, for this process and whatever it would start, a filter
(libseccomp, through pyseccomp's ctypes binding; the library ships with every Debian and
Ubuntu image, as apt needs it) that answers, instead of running them:

- EPERM: `open`/`openat` asking to write, create or truncate (`O_WRONLY`, `O_RDWR`,
  `O_CREAT`, `O_TRUNC`; `O_TMPFILE` needs a write mode), and `creat`;
- ENOSYS: `openat2` (its flags sit in a struct the filter cannot read: libc falls back
  to `openat`, which the filter can);
- EPERM: what changes a file or directory without an open for writing (unlink, rename,
  link, mkdir, mknod, chmod, chown, utimes, truncate, xattrs), what reaches another
  process (`ptrace`, `process_vm_writev`/`readv`, `process_madvise`, `pidfd_getfd`,
  `kill` and the other signals to anyone but itself, `move_pages`, `migrate_pages`),
  what changes the view of the system (`mount` and the new mount API, `umount2`,
  `unshare`, `setns`, `chroot`, `pivot_root`), what bypasses the filter or the
  kernel's checks (`io_uring_*`, `open_by_handle_at`, `execve`, `bpf`,
  `perf_event_open`, modules, kexec, keys), a new socket, locks on files it reads
  (`flock`, fcntl's record locks and leases: a lock could stall a writer elsewhere),
  and `TIOCSTI` (typing into a terminal).

Everything else runs: reads, `stat`, directory listings, `readlink`, `mmap` (a shared
writable mapping of a file opened read-only is refused by the kernel), writes to the fds
it already holds (its socket, stderr). The filter is native-architecture only: a
syscall of another ABI (int 0x80) kills the process (libseccomp's default). Syscalls this
libseccomp does not know by name are added by their x86_64 numbers.

`UnsupportedError` when libseccomp or pyseccomp is missing: the caller decides whether
to go on without (the exporter does not).
"""

from __future__ import annotations

import errno
import os
import platform
import termios
from typing import Any

from hostpool.errors import UnavailableError

WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC)
# the open calls and the argument that holds their flags
OPENS = {"open": 1, "openat": 2}

REFUSED = (
    "creat",
    # files and directories changed without an open for writing
    *("unlink", "unlinkat", "rmdir", "rename", "renameat", "renameat2"),
    *("link", "linkat", "symlink", "symlinkat", "mkdir", "mkdirat", "mknod", "mknodat"),
    *("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat"),
    *("truncate", "ftruncate", "fallocate", "utime", "utimes", "utimensat", "futimesat"),
    *("setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr"),
    *("setxattrat", "removexattrat"),
    # other processes
    *("ptrace", "process_vm_writev", "process_vm_readv", "process_madvise", "pidfd_getfd"),
    *("kill", "tkill", "rt_sigqueueinfo", "pidfd_send_signal", "move_pages", "migrate_pages"),
    # the system's view and the kernel's checks
    *("mount", "umount2", "unshare", "setns", "chroot", "pivot_root", "mount_setattr"),
    *("open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick"),
    *("io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at"),
    *("execve", "execveat", "bpf", "perf_event_open", "userfaultfd", "socket", "flock"),
    *("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    *("add_key", "request_key", "keyctl", "reboot", "swapon", "swapoff", "acct"),
)
# signals to a thread: only this process's own (raise() sends one to itself)
SELF_SIGNALS = {"tgkill": 0, "rt_tgsigqueueinfo": 0}
# fcntl commands that lock or lease (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW,
# F_SETLEASE)
FCNTL_LOCKS = (6, 7, 37, 38, 1024)
TIOCSTI = termios.TIOCSTI
# x86_64 numbers of syscalls newer than some libseccomp 2.5 releases know by name
X86_64_NUMBERS = {
    "mount_setattr": 442,
    "process_madvise": 440,
    "fchmodat2": 452,
    "setxattrat": 463,
    "removexattrat": 466,
    "open_tree_attr": 467,
}


class UnsupportedError(UnavailableError):
    """No seccomp here: libseccomp or its Python binding is missing, or the machine is
    not one whose numbers this module knows."""


def _library() -> Any:
    try:
        import pyseccomp  # type: ignore[import-untyped]
    except (ImportError, OSError, AttributeError, TypeError) as exc:
        # pyseccomp looks libseccomp up when imported: without it, a TypeError or OSError
        raise UnsupportedError(
            f"no seccomp: libseccomp or pyseccomp is missing ({exc}); install libseccomp2"
        ) from exc
    return pyseccomp


def _number(lib: Any, name: str) -> int | None:
    """The syscall's number here, or None where this machine has no such call."""
    number = int(lib.resolve_syscall(lib.Arch.NATIVE, name))
    if number >= 0:
        return number
    if platform.machine() == "x86_64":
        return X86_64_NUMBERS.get(name)
    return None


def read_only_filter() -> None:
    """Load the filter (see the module's docstring) into this process; it sets
    no_new_privs too (seccomp requires it of a process without CAP_SYS_ADMIN)."""
    lib = _library()
    if platform.machine() != "x86_64":
        # the write flags and the numbers above are x86_64's; another machine's are not
        # checked here, and a filter that lets writes through would only look safe
        raise UnsupportedError(f"no read-only filter for {platform.machine()} (x86_64 only)")
    refuse = lib.ERRNO(errno.EPERM)
    rules = lib.SyscallFilter(lib.ALLOW)
    for name, arg in OPENS.items():
        for flag in WRITE_FLAGS:
            rules.add_rule(refuse, name, lib.Arg(arg, lib.MASKED_EQ, flag, flag))
    rules.add_rule(lib.ERRNO(errno.ENOSYS), "openat2")
    for name in REFUSED:
        number = _number(lib, name)
        if number is not None:
            rules.add_rule(refuse, number)
    pid = os.getpid()
    for name, arg in SELF_SIGNALS.items():
        rules.add_rule(refuse, name, lib.Arg(arg, lib.NE, pid))
    for command in FCNTL_LOCKS:
        rules.add_rule(refuse, "fcntl", lib.Arg(1, lib.EQ, command))
    rules.add_rule(refuse, "ioctl", lib.Arg(1, lib.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    rules.load()
