"""The host view: every shared-memory object on this host, whoever made it (`model`: the
objects, holders and totals; `engines`: which engine a name belongs to; `scan`: read from
/proc, the tmpfs mounts of every mount namespace and /proc/sysvipc; `reap`: unlink the
orphans it is safe to free). Stands on `proc/`; the CLI and the exporter present it."""
