"""Where the time of one blocking ``hvd.allreduce_`` goes, stage by stage, next to raw MPI.

Run on 2 ranks::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,sm \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/stages.py --bytes 16777216 --one

Each round times 3 raw in-place ``comm.Allreduce`` calls and then 3 in-place
``hvd.allreduce_(x, op=hvd.Sum)`` calls on the same buffer. The engine's steps are wrapped
with clocks (a diagnostic: the wrappers add ~1 us each), and each rank prints the medians
of the last three quarters of the calls:

- call->post: the API call, the request and handle, up to posting the negotiation;
- post: encoding this rank's message and posting the non-blocking allgather;
- post->finish: waiting for the other ranks' messages;
- finish: reading them (the cycle cache's lookup);
- after->data: deciding the cycle and dispatching to the backend;
- data: the backend's data movement (``_reduce_into``), to compare with raw;
- data->return: setting the result and returning to the caller.

``--one`` sends the data as one MPI call (as ``HVD_MAGIC_ALLREDUCE_CHUNK_MB=0``; by default
a buffer over 1 MiB goes as MPI calls of 1 MiB): then the data stage makes the very call
raw MPI makes, and the rest is the runtime's overhead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import hvd_magic.collectives as hvd
from hvd_magic.collectives import state

STAGES = [("call->post", "call>", "post>"), ("post", "post>", "post<"),
          ("post->finish", "post<", "finish>"), ("finish", "finish>", "finish<"),
          ("after->data", "after>", "data>"), ("data", "data>", "data<"),
          ("data->return", "data<", "ret")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=int, default=1 << 20, help="buffer size in bytes")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--one", action="store_true", help="the data as one MPI call")
    args = ap.parse_args()
    hvd.init()
    eng = state.engine()
    backend = eng.mpi_backend
    if args.one:
        backend.chunk = 0
    comm = MPI.COMM_WORLD.Dup()
    clock = time.perf_counter
    marks: dict = {}

    def wrap(obj, attr: str, tag: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **k):
            marks.setdefault(tag + ">", []).append(clock())
            try:
                return inner(*a, **k)
            finally:
                marks.setdefault(tag + "<", []).append(clock())
        setattr(obj, attr, timed)

    wrap(eng, "_post_exchange", "post")
    wrap(eng, "_finish_exchange", "finish")
    wrap(eng, "_after_exchange", "after")
    wrap(backend, "_reduce_into", "data")
    x = np.zeros(args.bytes // 4, dtype=np.float32)
    x[:] = 0.0
    raws: list = []
    for _ in range(args.rounds):
        comm.Barrier()
        for _ in range(3):
            t = clock()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            raws.append(clock() - t)
        comm.Barrier()
        for _ in range(3):
            marks.setdefault("call>", []).append(clock())
            hvd.allreduce_(x, op=hvd.Sum, name="stages")
            marks.setdefault("ret", []).append(clock())
    if len(marks.get("data>", ())) != len(marks["call>"]):
        raise RuntimeError("some calls did not go through the engine's steps as expected")
    keep = slice(len(marks["call>"]) // 4, None)

    def med(a: str, b: str) -> float:
        return statistics.median((y - x0) * 1e6 for x0, y in zip(marks[a][keep], marks[b][keep]))

    parts = [f"{label} {med(a, b):.1f}" for label, a, b in STAGES]
    print(f"rank {hvd.rank()}: {args.bytes} B, raw {statistics.median(raws[len(raws) // 4:]) * 1e6:.1f} us, "
          f"hvd {med('call>', 'ret'):.1f} us | " + ", ".join(parts), flush=True)
    comm.Free()
    hvd.shutdown()


if __name__ == "__main__":
    main()
