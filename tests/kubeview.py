"""A node as the exporter DaemonSet sees it, simulated: the driver tests/test_kubernetes_view.py
runs inside fresh PID, mount and IPC namespaces (`unshare --pid --fork --mount --ipc
--mount-proc`), so /proc shows only the processes planted here and the test owns every
object it compares, on a busy host.

    python tests/kubeview.py node TOKEN   (inside the namespaces; prints one JSON document)

`node` mounts a private tmpfs on /dev/shm (the node's), leaves an orphan there, and starts
two "pods": each in its own mount namespace with its own tmpfs /dev/shm (a Memory
emptyDir), an orphan file in it (a crashed engine's), and an engine-like process of uid
65534 holding a file by a mapping only, one by an fd only, a memfd and a shared anonymous
mapping, kept alive while it sleeps. Then it reads the view each way asked on stdin (one
JSON list of [label, argv] per line: a `hostpool ...` command and the exporter's scrape)
and prints what each saw of the planted objects.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import secrets
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

HOLDER_UID = 65534
FILE_BYTES = 1 << 20
# the engines of the planted names: nothing else in these namespaces has them; nor has
# anything else a SysV segment in this IPC namespace
PLANTED_ENGINES = ("kvcached", "lmcache", "python", "vllm")
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]


def cgroup_root() -> str | None:
    """A cgroup hierarchy a process may be moved in without limits: cgroup v1's
    `name=systemd` (no controller), else the cgroup v2 mount; None if neither is mounted."""
    v2 = None
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f.read().decode(errors="replace").split("\n"):
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(" "), tail.split(" ")
            if len(fields) < 5 or len(rest) < 3:
                continue
            if rest[0] == "cgroup" and "name=systemd" in rest[2].split(","):
                return fields[4]
            if rest[0] == "cgroup2" and v2 is None:
                v2 = fields[4]
    return v2


def pod_cgroup_path(pod_uid: str, container_id: str, qos: str = "besteffort") -> str:
    """Where kubelet's systemd cgroup driver puts a container of containerd (relative)."""
    slice_ = f"kubepods-{qos}-pod{pod_uid.replace('-', '_')}.slice"
    return f"kubepods.slice/kubepods-{qos}.slice/{slice_}/cri-containerd-{container_id}.scope"


@contextlib.contextmanager
def pod_cgroup(pod_uid: str, container_id: str) -> Iterator[Callable[[int], None]]:
    """A container's cgroup as the systemd driver names it, made under `cgroup_root()` in
    a directory of its own (`hostpool-test-<random>/kubepods.slice/...`: never a real
    kubelet's, nor another test's; the path reads as from a nested cgroup namespace);
    yields `move(pid)`. On leaving: its processes moved back to the root, and every
    directory made here removed, deepest first."""
    root = cgroup_root()
    if root is None:
        raise RuntimeError("no cgroup hierarchy is mounted")
    path = f"{root}/hostpool-test-{secrets.token_hex(6)}"
    made = []
    try:
        for part in ("", *pod_cgroup_path(pod_uid, container_id).split("/")):
            path = f"{path}/{part}" if part else path
            os.mkdir(path)
            made.append(path)
    except BaseException:
        for directory in reversed(made):
            os.rmdir(directory)
        raise

    def move(pid: int) -> None:
        with open(f"{path}/cgroup.procs", "w") as f:
            f.write(str(pid))

    try:
        yield move
    finally:
        with open(f"{path}/cgroup.procs") as f:
            left = f.read().split()
        for pid in left:
            with contextlib.suppress(OSError), open(f"{root}/cgroup.procs", "w") as out:
                out.write(pid)  # ESRCH: gone meanwhile
        for directory in reversed(made):
            os.rmdir(directory)


def _planted_kind(engine: str, kind: str) -> bool:
    return engine in PLANTED_ENGINES or kind == "sysv"


def _segment(mode: int) -> int:
    shmid = int(_libc.shmget(IPC_PRIVATE, FILE_BYTES, IPC_CREAT | mode))
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    return shmid


def _attach(shmid: int) -> int:
    """Attach a segment and touch its pages; its address."""
    address = _libc.shmat(shmid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    ctypes.memset(address, 1, FILE_BYTES)
    return int(address)


def _write(path: str, mode: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.write(fd, b"\1" * FILE_BYTES)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _mount_tmpfs(path: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path], check=True)


def pod(token: str, index: str, shmid: str) -> None:
    """In its own mount namespace: a tmpfs /dev/shm, an orphan, then the holder."""
    _mount_tmpfs("/dev/shm")
    _write(f"/dev/shm/vllm_offload_{token}_{index}.mmap", 0o600)  # the crashed run's
    for name in (f"kvcached_{token}_{index}", f"psm_{token}_{index}"):
        _write(f"/dev/shm/{name}", 0o666)
    os.execvp(
        "setpriv",
        ["setpriv", f"--reuid={HOLDER_UID}", f"--regid={HOLDER_UID}", "--clear-groups",
         "--inh-caps=-all", "--bounding-set=-all",
         sys.executable, __file__, "holder", token, index, shmid],
    )  # fmt: skip


def holder(token: str, index: str, shmid: str) -> None:
    """An engine of another uid: a mapping-only file, an fd-only file, a memfd, anon
    shared; the first pod's also a SysV segment attached."""
    fd = os.open(f"/dev/shm/kvcached_{token}_{index}", os.O_RDWR)
    mapped = mmap.mmap(fd, FILE_BYTES)
    os.close(fd)
    kept = os.open(f"/dev/shm/psm_{token}_{index}", os.O_RDWR)
    memfd = os.memfd_create(f"lmcache_{token}_{index}")
    os.ftruncate(memfd, FILE_BYTES)
    os.pwrite(memfd, b"\1" * FILE_BYTES, 0)
    anon = mmap.mmap(-1, FILE_BYTES, flags=mmap.MAP_SHARED)
    anon.write(b"\1" * FILE_BYTES)
    mapped[0] = 1
    if index == "0":
        _attach(int(shmid))
    print("ready", flush=True)
    signal.pause()
    del kept, memfd, anon, mapped


def _planted(objects: list[dict[str, Any]], token: str, pids: set[int]) -> list[list[Any]]:
    """What a view says of the planted objects: comparable, sorted."""
    out = []
    for o in objects:
        ours = o["kind"] == "anon_shared" and {h["pid"] for h in o["holders"]} <= pids
        if token in (o["name"] or "") or ours or o["kind"] == "sysv":
            holders = sorted((h["pid"], h["fds"], h["mappings"]) for h in o["holders"])
            out.append([o["kind"], o["name"], o["engine"], o["size_bytes"], o["orphan"], holders])
    return sorted(out, key=repr)


def _aggregate(objects: list[dict[str, Any]]) -> dict[str, list[int]]:
    """'engine/kind/state' -> [objects, resident bytes], the planted engines only: what
    the exporter's hostpool_host_shm_objects and _bytes say."""
    out: dict[str, list[int]] = {}
    for o in objects:
        if _planted_kind(o["engine"], o["kind"]):
            key = f"{o['engine']}/{o['kind']}/{'orphaned' if o['orphan'] else 'held'}"
            count, size = out.get(key, [0, 0])
            out[key] = [count + 1, size + o["resident_bytes"]]
    return out


def _scrape(argv: list[str]) -> dict[str, list[int]]:
    """What the exporter started as given says of the planted engines' objects."""

    def planted(labels: dict[str, str]) -> str | None:
        if not _planted_kind(labels["engine"], labels["kind"]):
            return None
        return f"{labels['engine']}/{labels['kind']}/{labels['state']}"

    return _shm_series(_scrape_text(argv), planted)


def _shm_series(text: str, key_of: Callable[[dict[str, str]], str | None]) -> dict[str, list[int]]:
    """key -> [objects, bytes] of hostpool_host_shm_objects and _bytes, for the samples
    `key_of` keys (by their labels; None: left out) and that are not 0."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[int]] = {}
    for family in text_string_to_metric_families(text):
        at = {"hostpool_host_shm_objects": 0, "hostpool_host_shm_bytes": 1}.get(family.name)
        for sample in family.samples if at is not None else []:
            key = key_of(sample.labels)
            if key is not None and sample.value:
                out.setdefault(key, [0, 0])[at] = int(sample.value)
    return out


def _scrape_text(argv: list[str]) -> str:
    """Start the exporter as given (on a free port of 127.0.0.1), scrape it once, as soon as
    its first log line (`hostpool.exporter_serving`, with the URL) says it serves."""
    argv = list(argv)
    argv[argv.index("--port") + 1] = "0"
    argv[argv.index("--host") + 1] = "127.0.0.1"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()  # stderr is not a TTY: JSON lines; "" once it exited
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") != "hostpool.exporter_serving":
            proc.kill()
            raise RuntimeError(line + proc.communicate()[1][-2000:])
        with urllib.request.urlopen(event["url"], timeout=60) as r:
            text = r.read().decode()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # drained: its stop lines must not block it on the pipe
    return text


def reachable_by_every_uid() -> None:
    """Let the pods' uid reach this checkout, in this mount namespace only. A clone under
    a directory others cannot search (`mktemp -d` makes it 0700) is otherwise out of
    their reach: each such directory is covered by a 0755 tmpfs that holds its one entry
    on the path, bind-mounted back (stashed on a tmpfs at /mnt meanwhile)."""
    parts = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).split("/")
    for depth in range(2, len(parts)):
        closed, entry = "/".join(parts[:depth]), parts[depth]
        if os.stat(closed).st_mode & 0o001:
            continue
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"], check=True)
        os.mkdir("/mnt/stash")
        subprocess.run(["mount", "--bind", f"{closed}/{entry}", "/mnt/stash"], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", closed],
                       check=True)  # fmt: skip
        os.mkdir(f"{closed}/{entry}")
        subprocess.run(["mount", "--move", "/mnt/stash", f"{closed}/{entry}"], check=True)
        subprocess.run(["umount", "/mnt"], check=True)


def node(token: str) -> None:
    reachable_by_every_uid()
    _mount_tmpfs("/dev/shm")
    _write(f"/dev/shm/psm_{token}_node", 0o600)  # the node's own orphan
    held = _segment(0o666)  # attached by the first pod's engine
    orphan = _segment(0o600)  # attached once, then by nobody
    _libc.shmdt(ctypes.c_void_p(_attach(orphan)))
    pods = []
    for index in ("0", "1"):
        p = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private",
             sys.executable, __file__, "pod", token, index, str(held)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"pod {index} did not start")
        pods.append(p)
    results: dict[str, Any] = {"pids": [p.pid for p in pods]}
    for line in sys.stdin:
        label, kind, argv = json.loads(line)
        if kind == "scrape":
            results[label] = _scrape(argv)
        else:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                results[label] = {"error": proc.stderr[-2000:]}
                continue
            objects = json.loads(proc.stdout)["objects"]
            results[label] = {
                "planted": _planted(objects, token, {p.pid for p in pods}),
                "aggregate": _aggregate(objects),
            }
    print(json.dumps(results), flush=True)
    for p in pods:
        p.kill()
        p.wait()


@contextlib.contextmanager
def serving(text: str) -> Iterator[str]:
    """`text` served as a metrics page on a free port of 127.0.0.1 (a scrape target for a
    test's Prometheus: what an exporter answered once, kube-state-metrics' stand-in);
    yields `host:port`."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = text.encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass  # no line per scrape on stderr

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ---------------------------------------------------------------- a kubelet's node
#
#     python tests/kubeview.py kubelet TOKEN WORKDIR   (inside fresh namespaces, as node)
#
# A kubelet root (WORKDIR bind-mounted on /var/lib, so /var/lib/kubelet/pods/<uid>/...)
# with each of two pods' secret and projected token volumes (tmpfs) and, for the first,
# a Memory emptyDir; a tmpfs /run; the node's /dev/shm with an orphan. Each pod: a
# process in a cgroup named as kubelet's systemd driver names it, in its own mount
# namespace with its own /dev/shm holding a file, with a vLLM orphan and an `unknown`
# orphan beside it; the first pod's also holds a file of its emptyDir, where a vLLM
# orphan lies too. Then each view asked on stdin, as `node` does ("shm": the objects
# whose name has TOKEN, "json": the command's document, "series": the exporter's
# hostpool_host_shm_* series of the two pods), and one JSON document of them all.

KUBELET_PODS = "/var/lib/kubelet/pods"


def kubelet_pod(token: str, index: str, empty_dir: str) -> None:
    """A pod's engine, in its own mount namespace (a copy of the node's): its /dev/shm,
    and the emptyDir's held file for the first pod."""
    _mount_tmpfs("/dev/shm")
    for name in (f"vllm_offload_{token}_{index}.mmap", f"notes_{token}_{index}"):
        _write(f"/dev/shm/{name}", 0o600)  # the crashed run's; a file nobody names
    _write(f"/dev/shm/kvcached_{token}_{index}", 0o600)
    held = [os.open(f"/dev/shm/kvcached_{token}_{index}", os.O_RDWR)]
    if empty_dir:
        held.append(os.open(f"{empty_dir}/kvcached_{token}_ed", os.O_RDWR))
    print("ready", flush=True)
    signal.pause()
    del held


def _kubelet_volumes(token: str, index: int, uid: str) -> str:
    """The pod's token volumes (and the first pod's Memory emptyDir, returned; "" for the
    second), as kubelet mounts them: a tmpfs each."""
    volumes = f"{KUBELET_PODS}/{uid}/volumes"
    for kind, name, files in (
        ("secret", f"token-{index}", (f"tls_{token}_{index}.key", f"psm_{token}_secret{index}")),
        ("projected", f"kube-api-access-{index}", (f"token_{token}_{index}",)),
    ):
        path = f"{volumes}/kubernetes.io~{kind}/{name}"
        os.makedirs(path)
        _mount_tmpfs(path)
        for file in files:
            _write(f"{path}/{file}", 0o600)
    if index:
        return ""
    path = f"{volumes}/kubernetes.io~empty-dir/cache"
    os.makedirs(path)
    _mount_tmpfs(path)
    _write(f"{path}/vllm_offload_{token}_ed.mmap", 0o600)
    _write(f"{path}/kvcached_{token}_ed", 0o600)
    return path


def _pod_series(text: str, pods: set[str]) -> dict[str, list[int]]:
    """'engine/kind/state/area/pod_uid' -> [objects, bytes] of the pods' series."""
    names = ("engine", "kind", "state", "area", "pod_uid")
    return _shm_series(
        text,
        lambda labels: "/".join(labels[n] for n in names) if labels["pod_uid"] in pods else None,
    )


def _views(token: str, pods: set[str]) -> dict[str, Any]:
    """Each view stdin asks for (see above)."""
    results: dict[str, Any] = {}
    for line in sys.stdin:
        label, kind, argv = json.loads(line)
        if kind == "series":
            text = _scrape_text(argv)
            results[label] = {"pods": _pod_series(text, pods), "text": text}
            continue
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            results[label] = {"error": proc.stderr[-2000:], "status": proc.returncode}
            continue
        doc = json.loads(proc.stdout)
        if kind == "shm":
            doc = [o for o in doc["objects"] if token in (o["name"] or "")]
        results[label] = doc
    return results


def kubelet(token: str, workdir: str) -> None:
    reachable_by_every_uid()
    os.makedirs(f"{workdir}/lib")
    subprocess.run(["mount", "--bind", f"{workdir}/lib", "/var/lib"], check=True)
    _mount_tmpfs("/run")
    _write(f"/run/vllm_offload_{token}_run.mmap", 0o600)  # an engine's name, not its place
    _mount_tmpfs("/dev/shm")
    _write(f"/dev/shm/psm_{token}_node", 0o600)  # the node's own orphan
    uids = [str(uuid.uuid4()) for _ in range(2)]
    containers = [secrets.token_hex(32) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        pods = []
        for index, (uid, container) in enumerate(zip(uids, containers, strict=True)):
            empty_dir = _kubelet_volumes(token, index, uid)
            into = stack.enter_context(pod_cgroup(uid, container))
            p = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", sys.executable, __file__,
                 "kubelet-pod", token, str(index), empty_dir],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            stack.callback(p.wait)
            stack.callback(p.kill)
            into(p.pid)  # unshare execs python: the same process
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"pod {index} did not start")
            pods.append(p)
        results = _views(token, set(uids))
        results.update(uids=uids, containers=containers, pids=[p.pid for p in pods])
        for path in (
            f"/run/vllm_offload_{token}_run.mmap",
            f"{KUBELET_PODS}/{uids[0]}/volumes/kubernetes.io~secret/token-0/tls_{token}_0.key",
        ):
            results.setdefault("present", []).append(os.path.exists(path))
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    {"node": node, "pod": pod, "holder": holder, "kubelet": kubelet,
     "kubelet-pod": kubelet_pod}[mode](*rest)  # fmt: skip
