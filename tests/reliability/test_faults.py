"""Faults from real limits (or the syscall seam where the kernel cannot be made to fail):
each ends in the typed error or the counted fallback it should, never a crash."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from hostpool import AllocationError, HostPoolManager, ShmHostTensorAllocator
from hostpool.core.ledger import get_ledger
from hostpool.memory import cuda
from tests import helpers, memory_support

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def _child(code: str) -> subprocess.CompletedProcess[str]:
    proc = helpers.run_python(code, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc


def test_fd_limit_just_above_the_current_count() -> None:
    proc = _child(
        """
        import os, resource, torch
        from hostpool import ShmHostTensorAllocator, AllocationError
        from hostpool.core.ledger import get_ledger
        from tests import helpers
        a = ShmHostTensorAllocator("nofile")
        a.allocate((4096,), torch.uint8)  # warm: imports and probes open no fds later
        a.close()
        highest = max(int(n) for n in os.listdir("/proc/self/fd"))  # includes the listing's fd
        # Room for exactly one more fd: the memfd opens, mmap's dup of it does not.
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (highest + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
        try:
            a2 = ShmHostTensorAllocator("nofile")
            a2.allocate((4096,), torch.uint8)
            print("allocated?!")
        except AllocationError as e:
            print("refused", e.reason)
        assert [r for r in get_ledger().snapshot() if r.pool == "nofile"] == []
        assert helpers.fd_links() == {}
        failures = get_ledger().counters().failures_total
        print("counted", failures.get(("nofile", "fd_limit"), 0))
        """
    )
    assert "refused fd_limit" in proc.stdout and "counted 1" in proc.stdout


def test_memfd_unavailable_and_madvise_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    helpers.no_memfd(monkeypatch)
    helpers.no_madv_populate(monkeypatch)
    auto = ShmHostTensorAllocator("seam")
    t = auto.allocate((2 * MiB,), torch.uint8)
    region = auto.regions[0]
    assert (region.facts.backend, region.facts.populate_mode) == ("devshm", "map_populate")
    assert os.fstat(auto.fd).st_blocks * 512 == 2 * MiB
    with pytest.raises(AllocationError):
        ShmHostTensorAllocator("seam", shm_backend="memfd").allocate((4096,), torch.uint8)
    auto.close()
    del t


def test_cuda_registration_failing_at_chunk_k() -> None:
    fake = helpers.FakeCuda(fail_at=2)
    previous = cuda.set_runtime(fake)
    try:
        with HostPoolManager() as manager:
            alloc = manager.allocator("pinfault", pin=True, pin_chunk_bytes=MiB)
            with pytest.raises(AllocationError, match="cudaHostRegister"):
                alloc.allocate((4 * MiB,), torch.uint8)
            assert fake.registered == {} and fake.problems == []
            failures = get_ledger().counters().failures_total
            assert failures[("pinfault", "other")] >= 1
    finally:
        cuda.set_runtime(previous)


def test_tiny_tmpfs_ends_in_enospc(root: None, tmp_path: os.PathLike[str]) -> None:
    mnt = os.path.join(tmp_path, "tiny")
    os.mkdir(mnt)
    if os.system(f"mount -t tmpfs -o size=2m tmpfs {mnt}") != 0:
        pytest.skip("cannot mount tmpfs")
    try:
        proc = _child(
            f"""
            import torch
            from hostpool import ShmHostTensorAllocator, AllocationError
            from tests import helpers
            for populate in ("touch", "map_populate", "auto"):
                a = ShmHostTensorAllocator("enospc", shm_backend="devshm", fallback_dir={mnt!r},
                                           populate=populate)
                try:
                    a.allocate((16 << 20,), torch.uint8)
                except AllocationError as e:
                    print(populate, e.reason)
            assert helpers.fd_links() == {{}} and helpers.maps_lines("hostpool.") == []
            """
        )
        assert "touch no_space" in proc.stdout and "map_populate no_space" in proc.stdout
        assert "auto " in proc.stdout
    finally:
        os.system(f"umount {mnt}")


def test_hugetlb_cgroup_limit(root: None) -> None:
    """A hugetlb.2MB.max cgroup limit: refused before any page is touched, by a manager's
    budget and by the process-wide admission of a plain allocator alike."""
    with memory_support.hugetlb_cgroup("hostpool-test", 4 * MiB) as group:
        with helpers.reserved_hugepages(16):
            proc = _child(
                f"""
                import os, torch
                with open({os.path.join(group, "cgroup.procs")!r}, "w") as f:
                    f.write(str(os.getpid()))
                from hostpool import HostPoolManager, ShmHostTensorAllocator, AllocationError
                from tests import helpers
                with HostPoolManager() as m:
                    try:
                        m.allocator("cg", hugepages="required").allocate((16 << 20,), torch.uint8)
                    except AllocationError as e:
                        print("budget:", e.reason, "hugetlb.2MB.max" in str(e))
                try:
                    plain = ShmHostTensorAllocator("cg2", hugepages="required")
                    plain.allocate((16 << 20,), torch.uint8)
                    print("populated?!")
                except AllocationError as e:
                    print("plain:", e.reason, "hugetlb.2MB.max" in str(e))
                assert helpers.fd_links() == {{}}
                """
            )
        assert "budget: hugepages True" in proc.stdout
        assert "plain: hugepages True" in proc.stdout  # not a populate EFAULT, nor SIGBUS


def test_out_of_fds_while_lending_one_is_an_error_not_a_release() -> None:
    """borrow_fd at RLIMIT_NOFILE raises (the region is still there), not None (released);
    alloc_shm out of fds for the caller's dup undoes the allocation and counts the failure."""
    proc = _child(
        """
        import errno, json, os, resource, torch
        from hostpool import AllocationError, ShmHostTensorAllocator, alloc_shm
        from hostpool.core.ledger import get_ledger
        from tests import helpers
        a = ShmHostTensorAllocator("lend")
        t = a.allocate((4096,), torch.uint8)
        region = a.regions[0]
        os.close(region.borrow_fd())  # warm
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        highest = max(int(n) for n in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
        ballast = []
        while True:
            try:
                ballast.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        try:
            region.borrow_fd()
            print("lent?!")
        except OSError as e:
            print("borrow", errno.errorcode[e.errno])
        os.close(ballast.pop())
        dup = region.borrow_fd()
        print("same inode", os.fstat(dup).st_ino == os.fstat(a.fd).st_ino)
        os.close(dup)
        while ballast:
            os.close(ballast.pop())
        a.close()
        del t

        warm, fd, mm = alloc_shm((4096,), torch.uint8, pool="lend2")  # warm the path
        os.close(fd)
        del warm, mm
        for r in list(get_ledger().snapshot()):
            get_ledger().release(r.id)
        assert helpers.fd_links() == {}
        seen = []
        for extra in range(1, 8):
            highest = max(int(n) for n in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + extra, hard))
            try:
                got = alloc_shm((4096,), torch.uint8, pool="lend3")
            except AllocationError as e:
                seen.append([e.reason, "dup of the region" in str(e)])
                assert [r for r in get_ledger().snapshot() if r.pool == "lend3"] == []
                assert helpers.fd_links() == {}
                continue
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            os.close(got[1])
            break
        print("seen", json.dumps(seen))
        failures = get_ledger().counters().failures_total
        print("counted", failures.get(("lend3", "fd_limit"), 0), len(seen))
        """
    )
    out = proc.stdout
    assert "borrow EMFILE" in out and "same inode True" in out
    seen = json.loads(out.split("seen ", 1)[1].splitlines()[0])
    assert seen and all(reason == "fd_limit" for reason, _ in seen)
    assert ["fd_limit", True] in seen  # the dup for the caller was the one refused
    counted, failed = out.split("counted ", 1)[1].split()[:2]
    assert counted == failed
