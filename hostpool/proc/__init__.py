"""OS layer, read-only: shared-memory objects of any process as /proc shows them
(`procfs` one process, `scan` many at scale, `procgroup` grouped by object), why /proc
denies a read (`procaccess`), and names made safe for text output (`textsafe`)."""
