"""Issue 17.2: the share socket never changes directories it did not create, refuses a
live socket at its path, and removes only what this process created."""

from __future__ import annotations

import os
import signal
import socket
import stat

import pytest
from structlog.testing import capture_logs

from hostpool import HostPoolManager
from hostpool.errors import ConfigError, ShareSocketInUseError
from hostpool.share import PoolShareServer, attach, protocol
from tests.reliability.share_support import FULL_SUM, NOBODY, Server


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("allowed", [None, [NOBODY]])
def test_existing_directory_keeps_its_mode(tmp_path: os.PathLike[str], allowed: object) -> None:
    shared_tmp = os.path.join(tmp_path, "var-tmp")  # like /var/tmp: 1777, root's
    os.mkdir(shared_tmp)
    os.chmod(shared_tmp, 0o1777)
    path = os.path.join(shared_tmp, "x.sock")
    with HostPoolManager() as manager:
        server = PoolShareServer(manager, path, allowed_uids=allowed).start()  # type: ignore[arg-type]
        try:
            assert _mode(shared_tmp) == 0o1777
            assert stat.S_ISSOCK(os.lstat(path).st_mode)
        finally:
            server.close()
    assert _mode(shared_tmp) == 0o1777
    assert os.listdir(shared_tmp) == []  # its own socket removed, nothing else touched


def test_directories_it_creates_are_private_and_removed(tmp_path: os.PathLike[str]) -> None:
    top = os.path.join(tmp_path, "a")
    path = os.path.join(top, "b", "pool.sock")
    old_umask = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        with HostPoolManager() as manager, PoolShareServer(manager, path):
            assert _mode(top) == 0o700 and _mode(os.path.dirname(path)) == 0o700
            assert _mode(path) == 0o600
        with (
            HostPoolManager() as manager,
            PoolShareServer(manager, path, allowed_uids=[NOBODY]),
        ):
            assert _mode(top) == 0o711  # others may traverse, not list
            assert _mode(path) == 0o666  # SO_PEERCRED decides
    finally:
        os.umask(old_umask)
    assert not os.path.exists(top)
    assert os.listdir(tmp_path) == []


def test_directory_others_could_write_is_refused(tmp_path: os.PathLike[str]) -> None:
    loose = os.path.join(tmp_path, "loose")
    os.mkdir(loose)
    os.chmod(loose, 0o777)  # no sticky bit: anyone could swap the socket
    with HostPoolManager() as manager, pytest.raises(ConfigError, match="sticky"):
        PoolShareServer(manager, os.path.join(loose, "pool.sock")).start()
    assert _mode(loose) == 0o777 and os.listdir(loose) == []


def test_live_socket_is_refused_and_left_serving(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "d", "pool.sock")
    first = Server(path, os.path.join(tmp_path, "events.log"))
    try:
        inode = os.lstat(path).st_ino
        with HostPoolManager() as manager, pytest.raises(ShareSocketInUseError, match="already"):
            PoolShareServer(manager, path).start()
        assert os.lstat(path).st_ino == inode  # not unlinked, not replaced
        with attach(path, "sealed") as h:  # the first server still answers
            assert int(h.tensors[0].sum()) == 2 << 20
        assert first.touch() == FULL_SUM
    finally:
        first.proc.send_signal(signal.SIGKILL)  # dies without removing its socket
        first.stop()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)  # stale now: nobody listens
    with capture_logs() as logs, HostPoolManager() as manager, PoolShareServer(manager, path):
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert [e["path"] for e in logs if e["event"] == "hostpool.share_stale_socket_removed"] == [
        path
    ]
    assert not os.path.exists(path)


def test_socket_someone_else_put_there_is_not_removed(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "d", "pool.sock")
    with HostPoolManager() as manager:
        server = PoolShareServer(manager, path).start()
        os.unlink(path)  # an operator moved ours away and another program bound there
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(path)
        other.listen(1)
        try:
            server.close()
            assert stat.S_ISSOCK(os.lstat(path).st_mode)  # theirs, still there
            assert os.path.isdir(os.path.dirname(path))  # and so its directory
        finally:
            other.close()
            os.unlink(path)


def test_servers_racing_for_a_stale_socket_leave_one_winner(tmp_path: os.PathLike[str]) -> None:
    """Probe, unlink and bind happen under an flock of the directory: of eight servers
    started at once on a stale socket, one serves and seven get ShareSocketInUseError."""
    path = os.path.join(tmp_path, "d", "pool.sock")
    os.mkdir(os.path.dirname(path), 0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(path)  # bound, never listening: what a SIGKILLed server leaves
    stale.close()
    go_r, go_w = os.pipe()
    stop_r, stop_w = os.pipe()
    children = []
    for _ in range(8):
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a contender
            try:
                os.close(go_w)
                os.close(stop_w)
                os.read(go_r, 1)  # everyone starts when the parent closes go_w
                try:
                    server = PoolShareServer(HostPoolManager(), path).start()
                except ShareSocketInUseError:
                    os.write(out_w, b"in use")
                else:
                    os.write(out_w, b"serving")
                    os.read(stop_r, 1)
                    server.close()
            except BaseException as exc:
                os.write(out_w, repr(exc).encode())
            finally:
                os._exit(0)
        os.close(out_w)
        children.append((pid, out_r))
    os.close(go_r)
    os.close(stop_r)
    os.close(go_w)
    outcomes = []
    for _pid, out_r in children:
        outcomes.append(os.read(out_r, 4096).decode())
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(5)
        probe.connect(path)
        protocol.send(probe, {"op": "list"})
        answer, _, _ = protocol.receive(probe)
        probe.close()
    finally:
        os.close(stop_w)
        for pid, out_r in children:
            os.waitpid(pid, 0)
            os.close(out_r)
    assert sorted(outcomes) == ["in use"] * 7 + ["serving"], outcomes
    assert answer["ok"] is True  # the winner answers at the path
    assert not os.path.exists(path)  # and removed its socket when it stopped


# A neighbour who can write the socket's directory swaps the socket for a symlink to a
# victim file at the worst moment: right after the server's every step (an audit hook
# runs before each audited call, so it lands between bind and anything done after it).
# The server must never change the mode of what the path names by then.
SWAPPER = """
import os, stat, sys
path, victim = sys.argv[1], sys.argv[2]
swapped = []

def neighbour(event, args):
    if swapped or event.startswith(("os.unlink", "os.symlink", "os.remove")):
        return
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
            os.symlink(victim, path)
            swapped.append(event)
    except OSError:
        pass

sys.addaudithook(neighbour)
from hostpool import HostPoolManager
from hostpool.share import PoolShareServer
with HostPoolManager() as m:
    server = PoolShareServer(m, path, allowed_uids=[65534]).start()
    print("ready", flush=True)
    print(f"{stat.S_IMODE(os.stat(victim).st_mode):o} {swapped}", flush=True)
    server.close()
"""


def test_a_symlink_swapped_in_after_bind_is_never_chmod_ed(tmp_path: os.PathLike[str]) -> None:
    from tests import helpers

    victim = os.path.join(tmp_path, "victim")
    with open(victim, "w") as f:
        f.write("secret")
    os.chmod(victim, 0o600)
    path = os.path.join(tmp_path, "d", "pool.sock")
    os.mkdir(os.path.dirname(path), 0o700)
    child = helpers.python_child(SWAPPER, path, victim, stdin=False)
    assert child.stdout is not None
    mode, swapped = child.stdout.readline().split(" ", 1)
    child.stdout.close()
    assert child.wait(timeout=60) == 0
    assert "os." in swapped or "socket" in swapped, swapped  # the neighbour did act
    assert mode == "600", f"the server chmod-ed the victim through the symlink: {mode}"
    assert _mode(victim) == 0o600
    assert os.path.islink(path)  # the neighbour's symlink was not the server's to remove
