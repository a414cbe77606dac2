"""Which pod and container own each object (hostpool.host.pods): the cgroup names of
kubelet's two drivers and three runtimes, kubelet volume paths, and real processes moved
into real cgroups named as the systemd driver names them, scanned by `scan_host`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostpool.host.model import Holder, HostObject, HostTotals, HostView
from hostpool.host.pods import NO_POD, PodRef, kubelet_volume, parse_cgroup
from hostpool.host.scan import scan_host
from tests.kubeview import cgroup_root, pod_cgroup, pod_cgroup_path

UID = "1d2c3b4a-0000-4111-8222-333344445555"
UID_ = UID.replace("-", "_")
CID = "ab" * 32
STATIC = "0123456789abcdef0123456789abcdef"  # a static pod's uid: its config's hash


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        # systemd driver, cgroup v2: containerd, CRI-O, docker, guaranteed (no QoS slice)
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
         f"cri-containerd-{CID}.scope\n", PodRef(UID, CID)),
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
         f"crio-{CID}.scope\n", PodRef(UID, CID)),
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope\n", PodRef(UID, CID)),
        # kind's kubelet: the slices under a prefix
        (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
         f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
         PodRef(UID, CID)),
        # cgroupfs driver, cgroup v1: the pod line wins over the others; guaranteed
        (f"12:pids:/\n4:memory:/kubepods/burstable/pod{UID}/{CID}\n1:cpu:/\n0::/\n",
         PodRef(UID, CID)),
        (f"4:memory:/kubepods/pod{UID}/{CID}\n", PodRef(UID, CID)),
        (f"0::/kubepods/besteffort/pod{STATIC}/{CID}\n", PodRef(STATIC, CID)),
        # CRI-O under cgroupfs (no .scope); a container running systemd (nested cgroups)
        (f"0::/kubepods/burstable/pod{UID}/crio-{CID}\n", PodRef(UID, CID)),
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/init.scope\n",
         PodRef(UID, CID)),
        # read from another cgroup namespace: relative to the reader's root
        (f"0::/../../kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
         PodRef(UID, CID)),
        # CRI-O's monitor and the pod's own slice: the pod only; a line with the
        # container preferred
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
         PodRef(UID, None)),
        (f"1:name=systemd:/kubepods.slice/kubepods-pod{UID_}.slice\n"
         f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n", PodRef(UID, CID)),
        # no pod: a host service, a path that only looks like one, pod<uid> outside kubepods
        ("0::/system.slice/containerd.service\n", NO_POD),
        ("0::/user.slice/kubepods-notes.txt\n", NO_POD),
        (f"0::/machine.slice/pod{UID}/{CID}\n", NO_POD),
        (f"0::/kubepods.slice/kubepods-podnot-a-uid.slice/cri-containerd-{CID}.scope\n", NO_POD),
        ("", NO_POD),
    ],
)  # fmt: skip
def test_cgroup_names(cgroup: str, expected: PodRef) -> None:
    assert parse_cgroup(cgroup.encode()) == expected


def test_kubelet_volume_paths() -> None:
    for root in ("/var/lib/kubelet", "/var/lib/k0s/kubelet", "/proc/1/root/var/lib/kubelet"):
        volume = kubelet_volume(f"{root}/pods/{UID}/volumes/kubernetes.io~projected/kube-api")
        assert volume is not None
        assert (volume.pod_uid, volume.plugin, volume.name) == (
            UID, "kubernetes.io~projected", "kube-api",
        )  # fmt: skip
    assert kubelet_volume(f"/var/lib/kubelet/pods/{UID}/plugins/x") is None
    assert kubelet_volume("/dev/shm") is None
    assert kubelet_volume("/var/lib/kubelet/pods/nope/volumes/kubernetes.io~secret/t") is None


needs_cgroups = pytest.mark.skipif(
    os.geteuid() != 0 or cgroup_root() is None, reason="needs root and a cgroup hierarchy"
)


def _by_name(objects: tuple[HostObject, ...], token: str) -> dict[str, HostObject]:
    return {o.name.rpartition("/")[2]: o for o in objects if token in o.name}


HOLDERS = """
import os, sys
memfd = os.memfd_create("vllm_shared_" + sys.argv[1])
os.ftruncate(memfd, 4096)
own = os.memfd_create("vllm_own_" + sys.argv[1])
os.ftruncate(own, 4096)
if os.fork() == 0:
    os.close(own)
    os.write(1, b"child %d\\n" % os.getpid())  # one write each: lines never interleave
    sys.stdin.read()
    os._exit(0)
os.write(1, b"parent %d\\n" % os.getpid())
sys.stdin.read()
"""


@contextlib.contextmanager
def holders(token: str) -> Iterator[tuple[int, int]]:
    """HOLDERS running: (parent, child) pids, both holding the shared memfd until the
    end (their stdin closed)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLDERS, token],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        try:
            said = dict(proc.stdout.readline().split() for _ in range(2))  # in either order
            yield int(said["parent"]), int(said["child"])
        finally:
            proc.stdin.close()


@needs_cgroups
def test_holders_carry_their_pod_and_an_object_the_pod_they_agree_on() -> None:
    """Two processes of two pods hold one memfd: each holder has its own pod, the object
    none; the memfd only one holds is that pod's and container's."""
    token = secrets.token_hex(6)
    other_uid, other_cid = str(uuid.uuid4()), "cd" * 32
    with (
        pod_cgroup(UID, CID) as into_first,
        pod_cgroup(other_uid, other_cid) as into_second,
        holders(token) as (parent, child),
    ):
        into_first(parent)
        into_second(child)
        objects = _by_name(scan_host().objects, token)
        shared, own = objects[f"vllm_shared_{token}"], objects[f"vllm_own_{token}"]
        assert {(h.pid, h.pod_uid, h.container_id) for h in shared.holders} == {
            (parent, UID, CID), (child, other_uid, other_cid),
        }  # fmt: skip
        assert (shared.pod_uid, shared.container_id) == (None, None)
        assert [(h.pid, h.pod_uid) for h in own.holders] == [(parent, UID)]
        assert (own.pod_uid, own.container_id) == (UID, CID)
        assert shared.as_json()["holders"][0]["pod_uid"] in (UID, other_uid)


@contextlib.contextmanager
def _removed_after(path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        path.unlink()


NAMESPACE = """
set -e
mount -t tmpfs -o size=1m tmpfs /dev/shm
mkdir -p "$1/kubelet/pods/$2/volumes/kubernetes.io~secret/token"
mount -t tmpfs -o size=1m tmpfs "$1/kubelet/pods/$2/volumes/kubernetes.io~secret/token"
head -c 4096 /dev/zero > "/dev/shm/vllm_offload_$3.mmap"
head -c 4096 /dev/zero > "$1/kubelet/pods/$2/volumes/kubernetes.io~secret/token/token_$3"
echo ready
exec cat
"""


@needs_cgroups
def test_unheld_files_belong_to_their_volume_or_their_namespace(tmp_path: Path) -> None:
    """A container's own /dev/shm (in its mount namespace only) is its pod's and container's;
    a kubelet volume of another pod mounted there is that pod's, by its path."""
    token, volume_uid = secrets.token_hex(6), str(uuid.uuid4())
    covered = Path(f"/dev/shm/vllm_offload_{token}_node.mmap")  # the node's, no pod's
    covered.write_bytes(b"\1" * 4096)
    with (
        _removed_after(covered),
        pod_cgroup(UID, CID) as into_pod,
        subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private",
             "sh", "-c", NAMESPACE, "sh", str(tmp_path), volume_uid, token],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ) as proc,
    ):  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        try:
            into_pod(proc.pid)  # unshare execs sh, then cat: the same process
            assert proc.stdout.readline() == "ready\n"
            objects = _by_name(scan_host().objects, token)
        finally:
            proc.stdin.close()
    offload, secret = objects[f"vllm_offload_{token}.mmap"], objects[f"token_{token}"]
    # the node's /dev/shm, which the container's namespace shows covered by its own
    assert objects[covered.name].pod_uid is None
    assert offload.orphan and not offload.holders
    assert (offload.pod_uid, offload.container_id) == (UID, CID)
    assert (secret.pod_uid, secret.container_id) == (volume_uid, None)


@needs_cgroups
def test_pod_cgroup_is_named_as_the_systemd_driver_names_it() -> None:
    with (
        pod_cgroup(UID, CID) as into_pod,
        subprocess.Popen(["cat"], stdin=subprocess.PIPE) as proc,
    ):
        assert proc.stdin is not None
        into_pod(proc.pid)
        cgroup = Path(f"/proc/{proc.pid}/cgroup").read_bytes()
        proc.stdin.close()
    assert pod_cgroup_path(UID, CID).encode() in cgroup
    assert parse_cgroup(cgroup) == PodRef(UID, CID)


def _object(name: str, resident: int, pod: str | None, *, orphan: bool = False) -> HostObject:
    holders = () if orphan else (Holder(7, "python3", 1, 0, pod, None),)
    return HostObject("memfd", name, None, "vllm", None, resident, resident, holders, orphan,
                      None, pod_uid=pod)  # fmt: skip


def test_shm_by_pod_groups_most_resident_first_no_pod_last() -> None:
    from hostpool.cli.shm import by_pod, encode, render, render_pods

    other = str(uuid.uuid4())
    objects = [
        _object("a", 1 << 20, UID),
        _object("b", 1 << 10, None),
        _object("c", 2 << 20, other),
        _object("d", 2 << 20, UID, orphan=True),
    ]
    pods = by_pod(objects)
    assert [(p.pod_uid, [o.name for o in p.objects]) for p in pods] == [
        (UID, ["a", "d"]), (other, ["c"]), (None, ["b"]),
    ]  # fmt: skip
    assert pods[0].as_json() == {
        "pod_uid": UID, "objects": 2, "resident_bytes": 3 << 20, "orphaned_bytes": 2 << 20,
    }  # fmt: skip
    totals = HostTotals(0, 0, 0, 0, 0, 0)
    doc = json.loads(encode(HostView(tuple(objects), totals), objects, {"pods": []}))
    assert doc["pods"] == [] and [o["name"] for o in doc["objects"]] == ["a", "b", "c", "d"]
    out = io.StringIO()
    render_pods(HostView(tuple(objects), totals), pods, out)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"pod {UID}: 2 object(s), 3MiB resident, 2MiB orphaned"
    assert lines[1].split()[:2] == ["vllm", "memfd"] and "ORPHAN" in lines[2]
    assert lines[5].startswith("no pod: 1 object(s)")
    assert f"pod={UID}" not in out.getvalue()  # said by the headings
    out = io.StringIO()
    render(HostView(tuple(objects), totals), objects, out)
    by_engine = out.getvalue().splitlines()
    assert by_engine[1].endswith(f"pod={UID}  held by 7/python3")
    assert "pod=" not in by_engine[2]  # b: no pod


@needs_cgroups
def test_shm_by_pod_on_real_pods() -> None:
    """`hostpool shm --by pod --json` and its text: the memfd a pod's process holds is
    listed under that pod."""
    token = secrets.token_hex(6)
    with pod_cgroup(UID, CID) as into_pod, holders(token) as (parent, child):
        into_pod(parent)
        into_pod(child)
        shm = [sys.executable, "-m", "hostpool", "shm", "--by", "pod"]
        doc = json.loads(subprocess.run([*shm, "--json"], capture_output=True,
                                        check=True, timeout=300).stdout)  # fmt: skip
        text = subprocess.run(shm, capture_output=True, check=True, text=True, timeout=300)
    pod = next(p for p in doc["pods"] if p["pod_uid"] == UID)
    mine = [o for o in doc["objects"] if token in o["name"]]
    assert {(o["name"], o["pod_uid"], o["container_id"]) for o in mine} == {
        (f"vllm_shared_{token}", UID, CID), (f"vllm_own_{token}", UID, CID),
    }  # fmt: skip
    assert pod["objects"] >= 2 and pod["resident_bytes"] >= 0
    listed = [o["pod_uid"] for o in doc["objects"]]
    assert listed == sorted(listed, key=lambda u: [p["pod_uid"] for p in doc["pods"]].index(u))
    heading = text.stdout.split(f"pod {UID}: ", 1)[1]
    assert f"vllm_own_{token}" in heading.split("\npod ", 1)[0].split("\nno pod", 1)[0]
