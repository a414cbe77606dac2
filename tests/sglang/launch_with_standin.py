"""`python tests/sglang/launch_with_standin.py ARGS...` is `python -m sglang.launch_server
ARGS...` with the torchvision stand-ins of `cpu_import` put in place first: how far the
real server gets on a CPU-only host once past sglang's import of torchvision (which no
CPU torch can load). Test support only. Spawned children re-run this file as
`__mp_main__`, so they get the stand-ins too.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sglang.cpu_import import install_torchvision_stand_in

install_torchvision_stand_in()

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"  # run_module puts the module's file there
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
