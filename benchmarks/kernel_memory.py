"""Memory of a Jupyter kernel (and of its ranks) over many live ``%%hvd`` cells.

A real kernel (jupyter_client, as a notebook drives it) runs ``--cells`` cells that each
allreduce and print one line, with the live panel (the default in a kernel with ipywidgets).
It prints the kernel's and each rank's resident memory after 50 cells and at the end, and
the growth between them. Target: the kernel grows by less than 10 MB from cell 50 to 1,000.

    .venv/bin/python benchmarks/kernel_memory.py [--cells 1000] [--np 2] [--no-stream]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import psutil
from jupyter_client.manager import start_new_kernel

CELL = "%%hvd{flags}\nx = hvd.allreduce(np.ones(4)); print('step', x[0])"


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=1000)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--no-stream", action="store_true", help="text output, no live panel")
    args = ap.parse_args()
    flags = " --no-stream" if args.no_stream else ""
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)

    def run(code: str) -> None:
        reply = kc.execute_interactive(code, timeout=120, output_hook=lambda _m: None)
        if reply["content"]["status"] != "ok":
            sys.exit(f"kernel_memory: a cell failed: {reply['content'].get('evalue')}")

    try:
        run("%load_ext hvd_magic")
        run(f"%%hvd -np {args.np}{flags} --out pids\nimport os, numpy as np\n"
            "import hvd_magic.collectives as hvd\nos.getpid()")
        run("print(list(pids.values()))")
        kernel = km.provisioner.process.pid
        ranks = [c.pid for c in psutil.Process(kernel).children(recursive=True)
                 if c.cmdline()[1:3] == ["-m", "hvd_magic.kernel.ranks.engine"]]
        marks, t0 = {}, time.monotonic()
        for i in range(1, args.cells + 1):
            run(CELL.format(flags=flags))
            if i in (50, args.cells):
                run("import gc as _gc; _gc.collect()")
                gc.collect()
                marks[i] = (rss_mb(kernel), [rss_mb(p) for p in ranks])
                print(f"after {i:5d} cells: kernel {marks[i][0]:7.1f} MB, ranks "
                      + ", ".join(f"{m:.1f}" for m in marks[i][1]) + " MB "
                      f"({(time.monotonic() - t0) / i * 1000:.0f} ms a cell)", flush=True)
    finally:
        km.shutdown_kernel()
        kc.stop_channels()
    if 50 in marks and args.cells > 50:
        grow = marks[args.cells][0] - marks[50][0]
        rank_grow = max(b - a for a, b in zip(marks[50][1], marks[args.cells][1]))
        verdict = "ok  " if grow < 10 else "MISS"
        print(f"{verdict} kernel growth from cell 50 to {args.cells}: {grow:+.1f} MB "
              f"(target < 10 MB); largest rank growth {rank_grow:+.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
