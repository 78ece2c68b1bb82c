"""Integer reductions against numpy's wrapping arithmetic: 8-bit sums that overflow must wrap
(uint8 229 + 229 -> 202, int8 100 + 100 -> -56), whatever the MPI library's own reduction
code does with them (Open MPI 5's vectorized ``op/avx`` saturates 8- and 16-bit sums of 16
elements and more).

Every integer dtype, Sum/Min/Max/Product, sizes crossing the vector widths (15/16/31/32/64,
odd sizes), fused buffers, the shared-memory sizes (64 KiB..1 MiB) and 1 Mi elements; in
place and out of place; the numpy face and the torch face; the global set and (3 ranks and
more) a process set; reducescatter. Run once per mode in one launch: the default data path
(MPI, shared memory, 1 MiB pieces), every size as one MPI call, and torch.distributed/gloo.
Each rank's inputs are known to every rank, so every rank computes the reference itself.

Exits nonzero with one line per failed check, prefixed by the rank."""
import functools
import os
import sys
import traceback

import numpy as np
import torch

import hvd_magic.collectives as hvd
import hvd_magic.torch as th
from hvd_magic.collectives.backends.common import scatter_rows

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60")   # a bug fails, never hangs

FAILS = []
MODE = ""
DTYPES = ["uint8", "int8", "int16", "int32", "int64"]
OPS = {"Sum": (hvd.Sum, np.add), "Min": (hvd.Min, np.minimum), "Max": (hvd.Max, np.maximum),
       "Product": (hvd.Product, np.multiply)}
# across the vector widths of 8-bit elements (16, 32, 64 bytes), odd sizes, then the
# shared-memory sizes (64 KiB..1 MiB of uint8) and 1 Mi elements (8 MiB of int64: MPI pieces)
SIZES = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 1000, 4099, 65536, 65537, 300001,
         1 << 20]
TORCH_SIZES = [15, 16, 33, 64, 4099, 65536, 1 << 20]


def fail(msg):
    FAILS.append(f"[{MODE}] {msg}")


def values(rank, dtype, size, salt):
    """Rank ``rank``'s input: integers over the whole range of ``dtype`` (so sums and
    products overflow), the same on every rank that asks."""
    rng = np.random.default_rng([rank, size, salt, DTYPES.index(dtype)])
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)


def expected(members, dtype, size, salt, ufunc):
    return functools.reduce(ufunc, [values(k, dtype, size, salt) for k in members])


def same(label, got, want):
    got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        fail(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
        return
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[0]
        fail(f"{label}: {bad.size} of {want.size} elements differ, first at flat index {i}: "
             f"got {got.flat[i]}, want {want.flat[i]} (numpy's wrapping arithmetic)")


def case(label, fn):
    try:
        fn()
    except Exception:  # noqa: BLE001
        fail(f"{label}: raised\n{traceback.format_exc()}")


def the_examples(ps, members):
    """The values of the report: 229 + 229 and 100 + 100 at 15 and 16 elements."""
    k = len(members)
    for size in (15, 16, 64):
        got = hvd.allreduce(np.full(size, 229, np.uint8), op=hvd.Sum, process_set=ps)
        same(f"uint8 229 x {k} ranks, {size} elements", got, np.full(size, 229 * k % 256, np.uint8))
        got = hvd.allreduce(np.full(size, 100, np.int8), op=hvd.Sum, process_set=ps)
        same(f"int8 100 x {k} ranks, {size} elements", got,
             np.full(size, 100 * k, np.int64).astype(np.int8))


def numpy_face(ps, members, where):
    r = hvd.rank()
    for dtype in DTYPES:
        for size in SIZES:
            for opname, (op, ufunc) in OPS.items():
                label = f"{where} numpy {dtype} {size} {opname}"

                def run():
                    x = values(r, dtype, size, 1)
                    want = expected(members, dtype, size, 1, ufunc)
                    same(label, hvd.allreduce(x, op=op, process_set=ps), want)
                    same(label + " (input untouched)", x, values(r, dtype, size, 1))
                    hvd.allreduce_(x, op=op, process_set=ps)
                    same(label + " in place", x, want)
                case(label, run)
    # fused: several small tensors of one dtype in one buffer (grouped, and async at once)
    for dtype in DTYPES:
        sizes = [15, 16, 31, 64, 100, 7]
        for opname, (op, ufunc) in OPS.items():
            label = f"{where} numpy fused {dtype} {opname}"

            def run():
                xs = [values(r, dtype, s, 2 + i) for i, s in enumerate(sizes)]
                wants = [expected(members, dtype, s, 2 + i, ufunc) for i, s in enumerate(sizes)]
                outs = hvd.grouped_allreduce(xs, op=op, process_set=ps)
                for i, (got, want) in enumerate(zip(outs, wants)):
                    same(f"{label} grouped #{i}", got, want)
                hs = [hvd.allreduce_async_(x, op=op, process_set=ps) for x in xs]
                for i, (h, x, want) in enumerate(zip(hs, xs, wants)):
                    hvd.synchronize(h)
                    same(f"{label} async in place #{i}", x, want)
            case(label, run)
    # reducescatter: rows of 40 elements, rank i gets its rows of the reduction
    k, me = len(members), members.index(r)
    for dtype in DTYPES:
        for rows in (1, 7, 2000):
            for opname, (op, ufunc) in OPS.items():
                label = f"{where} numpy reducescatter {dtype} {rows}x40 {opname}"

                def run():
                    x = values(r, dtype, rows * 40, 30).reshape(rows, 40)
                    want = expected(members, dtype, rows * 40, 30, ufunc).reshape(rows, 40)
                    share = scatter_rows(rows, k)
                    lo = sum(share[:me])
                    got = hvd.reducescatter(x, op=op, process_set=ps)
                    same(label, got, want[lo:lo + share[me]])
                case(label, run)


def torch_face(ps, members, where):
    r = th.rank()
    # (torch.distributed's gloo has no int16: "Invalid scalar type")
    for dtype in DTYPES if MODE != "gloo" else [d for d in DTYPES if d != "int16"]:
        tdt = getattr(torch, dtype)
        for size in TORCH_SIZES:
            for opname, (op, ufunc) in OPS.items():
                label = f"{where} torch {dtype} {size} {opname}"

                def run():
                    x = torch.from_numpy(values(r, dtype, size, 3))
                    want = expected(members, dtype, size, 3, ufunc)
                    got = th.allreduce(x, op=op, process_set=ps)
                    if got.dtype != tdt:
                        fail(f"{label}: dtype {got.dtype}")
                    same(label, got, want)
                    th.allreduce_(x, op=op, process_set=ps)
                    same(label + " in place", x, want)
                case(label, run)
        label = f"{where} torch grouped {dtype} Sum"

        def grouped():
            xs = [torch.from_numpy(values(r, dtype, s, 40 + s)) for s in (16, 33, 64)]
            outs = th.grouped_allreduce(xs, op=th.Sum, process_set=ps)
            for s, got in zip((16, 33, 64), outs):
                same(f"{label} {s}", got, expected(members, dtype, s, 40 + s, np.add))
        case(label, grouped)
        label = f"{where} torch reducescatter {dtype} Sum"

        def rs():
            k, me = len(members), members.index(r)
            x = torch.from_numpy(values(r, dtype, 64 * 3, 50)).reshape(64, 3)
            want = expected(members, dtype, 64 * 3, 50, np.add).reshape(64, 3)
            share = scatter_rows(64, k)
            lo = sum(share[:me])
            same(label, th.reducescatter(x, op=th.Sum, process_set=ps), want[lo:lo + share[me]])
        case(label, rs)


def run_all():
    n, r = hvd.size(), hvd.rank()
    every = list(range(n))

    def agreed():
        # every rank of a communicator reduces the same way (the backend's check of MPI's
        # reductions is agreed over it)
        from hvd_magic.collectives import state
        mine = sorted(state.engine().mpi_backend.numpy_reduced)
        if hvd.allgather_object(mine) != [mine] * n:
            fail(f"ranks disagree on the reductions done by numpy: {hvd.allgather_object(mine)}")
        if r == 0 and MODE == "mpi":
            print(f"reduced through numpy (MPI's own got them wrong): {mine}", flush=True)
    if MODE != "gloo":
        case("agreed", agreed)
    case("examples", lambda: the_examples(hvd.global_process_set, every))
    if MODE != "gloo":
        numpy_face(hvd.global_process_set, every, "global")
    torch_face(hvd.global_process_set, every, "global")
    if n >= 3 and MODE != "gloo":       # (process sets other than the global one: MPI only)
        members = list(range(1, n))
        ps = hvd.add_process_set(reversed(members))
        if ps.included():
            case("set examples", lambda: the_examples(ps, members))
            numpy_face(ps, members, f"set {members}")
            torch_face(ps, members, f"set {members}")
        hvd.barrier()
        hvd.remove_process_set(ps)


def main():
    global MODE
    for mode, env in (("mpi", {}),
                      # no shared memory, no pieces: every size is one MPI call
                      ("onecall", {"HVD_MAGIC_ALLREDUCE_CHUNK_MB": "0"}),
                      ("gloo", {"HOROVOD_CPU_OPERATIONS": "gloo"})):
        if len(sys.argv) > 1 and mode not in sys.argv[1:]:
            continue
        MODE = mode
        for k in ("HOROVOD_CPU_OPERATIONS", "HVD_MAGIC_ALLREDUCE_CHUNK_MB"):
            os.environ.pop(k, None)
        os.environ.update(env)
        hvd.init(process_sets="dynamic")
        try:
            run_all()
        except Exception:  # noqa: BLE001
            fail(f"raised\n{traceback.format_exc()}")
        finally:
            hvd.shutdown()
    r = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    for f in FAILS[:40]:
        print(f"rank {r}: FAIL {f}", file=sys.stderr)
    if FAILS:
        print(f"rank {r}: {len(FAILS)} failures", file=sys.stderr)
        sys.exit(1)
    print(f"rank {r}: coll_int8 OK")


if __name__ == "__main__":
    main()
