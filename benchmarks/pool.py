"""The pool behind %%hvd against ipyparallel's own MPI cluster, in one run.

    .venv/bin/python benchmarks/pool.py [--starts 3] [--cells 200] [--json PATH]

1. Start to first output at 2 ranks, each trial in a fresh Python process with an IPython
   shell (a fresh kernel): hvd_magic is timed from ``run_cell("%%hvd -np 2\\nprint(...)")``
   to the first line of output reaching the renderer; ipyparallel from
   ``Cluster(engines="mpi", n=2)`` with its defaults (start_and_connect_sync, then the same
   print) to that output being received. Target: hvd_magic under 2.5 s.
2. Round trip of an empty cell on a warm 2-rank pool through the same IPython shell:
   ``%%hvd`` against ipyparallel's ``%%px`` (on its own MPI cluster), interleaved in blocks
   of 20 so noise hits both alike. Target: %%hvd within 1.2x of %%px.

Lines starting with ``MISS`` mark missed targets (``run_all.py --strict`` fails on them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_btl": "self,sm", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}

START_HVD = r"""
import time, sys
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "hvd_magic")
from hvd_magic.magics.magics import HvdMagics
from hvd_magic.kernel.notebook.output import TextSink
first = []
class Sink(TextSink):
    def stream(self, rank, name, text):
        if not first:
            first.append(time.monotonic())
        super().stream(rank, name, text)
HvdMagics.sink_factory = lambda stream=True: Sink(out=open("/dev/null", "w"),
                                                  err=open("/dev/null", "w"))
t0 = time.monotonic()
res = ip.run_cell("%%hvd -np 2\nprint('first')")
assert res.success, res.error_in_exec
print("RESULT", first[0] - t0)
ip.run_line_magic("hvd", "stop")
"""

START_IPP = r"""
import time
t0 = time.monotonic()
import ipyparallel as ipp
cluster = ipp.Cluster(engines="mpi", n=2, log_level=40)
rc = cluster.start_and_connect_sync()
ar = rc[:].execute("print('first')", silent=False, block=False)
ar.get(); ar.wait_for_output(5)
t1 = time.monotonic()
assert ar.stdout == ["first\n", "first\n"], ar.stdout
print("RESULT", t1 - t0)
cluster.stop_cluster_sync()
"""

ROUNDTRIP = r"""
import json, statistics, sys, time
import ipyparallel as ipp
from IPython.testing.globalipapp import start_ipython
cells = int(sys.argv[1])
ip = start_ipython()
ip.run_line_magic("load_ext", "hvd_magic")
cluster = ipp.Cluster(engines="mpi", n=2, log_level=40,
                      controller_args=["--HeartMonitor.period=100"], delay=0)
rc = cluster.start_and_connect_sync()
rc.wait_for_engines(2, timeout=60)
view = rc[:]
view.block = True                                  # %%px waits for the engines, as %%hvd does
view.activate()
assert ip.run_cell("%%hvd -np 2\npass").success
times = {"hvd": [], "px": []}
cell = {"hvd": "%%hvd\npass", "px": "%%px\npass"}
for block in range(cells // 20 + 1):
    order = ["hvd", "px"] if block % 2 else ["px", "hvd"]
    for name in order:
        for _ in range(20):
            t = time.perf_counter()
            r = ip.run_cell(cell[name], silent=True)
            times[name].append(time.perf_counter() - t)
            assert r.success, r.error_in_exec
ip.run_line_magic("hvd", "stop")
cluster.stop_cluster_sync()
print("RESULT", json.dumps({k: v[20:] for k, v in times.items()}))
"""


def _child(code: str, *args: str, timeout: float = 180) -> str:
    env = dict(os.environ)
    for k, v in ROOT_ENV.items():
        env.setdefault(k, v)
    bindir = os.path.dirname(sys.executable)       # the venv's mpiexec, for ipyparallel
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return line[len("RESULT "):]
    raise RuntimeError(f"benchmark child failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                       f"{p.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=3, help="fresh-process start trials each")
    ap.add_argument("--cells", type=int, default=200, help="empty cells timed per variant")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()
    out: dict = {"hvd_start_s": [], "ipp_start_s": []}
    for _ in range(args.starts):               # alternate, so drift hits both
        out["hvd_start_s"].append(float(_child(START_HVD)))
        out["ipp_start_s"].append(float(_child(START_IPP)))
    rt = json.loads(_child(ROUNDTRIP, str(args.cells), timeout=600))
    hvd_ms = statistics.median(rt["hvd"]) * 1e3
    px_ms = statistics.median(rt["px"]) * 1e3
    hvd_start = statistics.median(out["hvd_start_s"])
    ipp_start = statistics.median(out["ipp_start_s"])
    print("pool start to first output, 2 ranks (median of "
          f"{args.starts} fresh processes; all: hvd {out['hvd_start_s']}, "
          f"ipp {out['ipp_start_s']})")
    print(f"  hvd_magic %%hvd -np 2           {hvd_start:6.2f} s")
    print(f"  ipyparallel Cluster(mpi) dflt   {ipp_start:6.2f} s")
    print(f"empty cell round trip on a warm 2-rank pool (median of {len(rt['hvd'])})")
    print(f"  %%hvd                           {hvd_ms:6.2f} ms")
    print(f"  %%px                            {px_ms:6.2f} ms   ratio {hvd_ms / px_ms:.2f}x")
    ok_start, ok_rt = hvd_start < 2.5, hvd_ms <= 1.2 * px_ms
    print(f"{'OK  ' if ok_start else 'MISS'} start under 2.5 s: {hvd_start:.2f} s")
    print(f"{'OK  ' if ok_rt else 'MISS'} round trip within 1.2x of %%px: {hvd_ms / px_ms:.2f}x")
    out.update(hvd_start_median_s=hvd_start, ipp_start_median_s=ipp_start,
               hvd_roundtrip_ms=hvd_ms, px_roundtrip_ms=px_ms)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
