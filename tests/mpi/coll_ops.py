"""Every collective, over dtypes, shapes and tensor types, checked against numpy references
computed from every rank's known inputs. Run once per mode in one launch: the default (MPI
path, fused buckets), no fusion, 1 KiB MPI pieces, and torch.distributed/gloo.

Exits nonzero with one line per failed check, prefixed by the rank."""
import os
import sys
import time
import traceback

import numpy as np
import torch

import hvd_magic.collectives as hvd
from hvd_magic.collectives.backends.common import scatter_rows

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")   # a bug fails, never hangs

FAILS = []
MODE = ""


def fail(msg):
    FAILS.append(f"[{MODE}] {msg}")


def case(label):
    """Decorator-ish context: run fn, record any exception as a failure."""
    def deco(fn):
        try:
            fn()
        except Exception:
            fail(f"{label}: raised\n{traceback.format_exc()}")
        return fn
    return deco


NP_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
TORCH_DTYPES = NP_DTYPES + ["bfloat16"]
SHAPES = [(), (0,), (3, 0), (5,), (3, 4), (64, 80)]   # (64, 80): > 4 KiB for every dtype but int8/uint8
SIGNED = {"int8", "int32", "int64"}


def values(rank, shape, dtype, kind="sum"):
    """Exactly representable in every dtype (also float16/bfloat16); no overflow at 3 ranks."""
    n = int(np.prod(shape)) if shape else 1
    i = np.arange(n, dtype=np.int64)
    if kind == "product":
        v = (i + rank) % 3                                   # 0, 1, 2: product <= 8
        if dtype in SIGNED:
            v = v - 1                                        # -1, 0, 1
    else:
        v = (i * 7 + rank * 5) % 21                          # 0..20
        if dtype in SIGNED or dtype.startswith(("float", "bfloat")):
            v = v - 10                                       # -10..10 (negative: average toward zero)
    if dtype.startswith(("float", "bfloat")):
        return (v / 2.0).reshape(shape)                      # halves: exact in bfloat16 too
    return v.reshape(shape)


def make(arr64, dtype, fw):
    """numpy int/float64 values -> tensor of dtype in framework fw ('np' or 'torch')."""
    if fw == "np":
        return np.asarray(arr64).astype(dtype)
    if dtype == "bfloat16":
        return torch.tensor(np.asarray(arr64, dtype=np.float64)).to(torch.bfloat16)
    return torch.from_numpy(np.array(np.asarray(arr64).astype(dtype), copy=True))


def to_np(x):
    """Result -> float64 / int64 numpy for comparison."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def dtype_of(x):
    return str(x.dtype).replace("torch.", "")


def check_result(label, got, ref, dtype, fw, shape=None, exact=False):
    shape = ref.shape if shape is None else shape
    if fw == "np" and not isinstance(got, np.ndarray):
        return fail(f"{label}: expected numpy result, got {type(got).__name__}")
    if fw == "torch" and not isinstance(got, torch.Tensor):
        return fail(f"{label}: expected torch result, got {type(got).__name__}")
    if dtype_of(got) != dtype:
        return fail(f"{label}: dtype {dtype_of(got)} != {dtype}")
    if tuple(got.shape) != tuple(shape):
        return fail(f"{label}: shape {tuple(got.shape)} != {tuple(shape)}")
    g = to_np(got).astype(np.float64) if dtype not in ("int64", "uint8", "int8", "int32", "bool") else to_np(got)
    if dtype in ("float16", "bfloat16") and not exact:
        tol = dict(rtol=1e-2, atol=1e-2)
    elif dtype == "float32":
        tol = dict(rtol=1e-6, atol=1e-6)
    else:
        tol = dict(rtol=1e-12, atol=0)
    r = np.asarray(ref)
    ok = np.array_equal(g, r) if (exact or dtype in ("int8", "uint8", "int32", "int64", "bool")) \
        else np.allclose(g, r, **tol)
    if not ok:
        bad = np.argwhere(~np.isclose(np.asarray(g, np.float64), np.asarray(r, np.float64), **tol)) \
            if g.size else []
        fail(f"{label}: values differ (first bad index {bad[:1].tolist() if len(bad) else '?'})\n"
             f"   got {np.asarray(g).reshape(-1)[:8]}\n   ref {np.asarray(r).reshape(-1)[:8]}")


def quantize(ref, dtype):
    """What a half-precision result holds after rounding from float32."""
    if dtype == "float16":
        return ref.astype(np.float32).astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return torch.tensor(ref.astype(np.float32)).to(torch.bfloat16).float().numpy().astype(np.float64)
    return ref


def reduce_ref(inputs, op, dtype, pre=1.0, post=1.0):
    """Reference reduction of the per-rank value arrays (float64 or int64)."""
    is_int = not dtype.startswith(("float", "bfloat"))
    xs = [np.asarray(x, dtype=np.int64 if is_int else np.float64) for x in inputs]
    if pre != 1.0:
        xs = [(x * pre) for x in xs]
        if is_int:
            xs = [np.trunc(x).astype(np.int64) for x in xs]
    if op in (hvd.Sum, hvd.Average):
        acc = sum(xs[1:], xs[0].copy())
    elif op == hvd.Min:
        acc = np.minimum.reduce(xs)
    elif op == hvd.Max:
        acc = np.maximum.reduce(xs)
    else:
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc * x
    if op == hvd.Average:
        acc = np.trunc(acc / len(xs)).astype(acc.dtype) if is_int else acc / len(xs)
    if post != 1.0:
        acc = acc * post
        if is_int:
            acc = np.trunc(acc).astype(np.int64)
    if is_int:
        acc = acc.astype(dtype).astype(np.int64)
    return acc


def run_all():
    r, n = hvd.rank(), hvd.size()
    NAME = MODE + "."

    # ------------------------------------------------------------ allreduce, every op and dtype
    OPS = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
    for fw, dtypes in (("np", NP_DTYPES), ("torch", TORCH_DTYPES)):
        for dtype in dtypes:
            handles = []
            for shape in SHAPES:
                for op in OPS:
                    kind = "product" if op == hvd.Product else "sum"
                    label = f"allreduce {fw} {dtype} {shape} {op.name}"
                    x = make(values(r, shape, dtype, kind), dtype, fw)
                    ref = reduce_ref([values(k, shape, dtype, kind) for k in range(n)], op, dtype)
                    ref = quantize(ref, dtype)
                    try:
                        if shape == (5,):     # blocking single call
                            got = hvd.allreduce(x, name=NAME + label, op=op)
                            check_result(label, got, ref, dtype, fw)
                        else:                 # async: several ready together -> fused
                            handles.append((label, hvd.allreduce_async(x, name=NAME + label, op=op), ref))
                    except Exception:
                        fail(f"{label}: raised\n{traceback.format_exc()}")
            for label, h, ref in handles:
                try:
                    check_result(label, hvd.synchronize(h), ref, dtype, fw)
                except Exception:
                    fail(f"{label}: raised\n{traceback.format_exc()}")

    # prescale / postscale (floats and exact integer factors)
    for fw in ("np", "torch"):
        for dtype in ("float16", "float32", "float64", "int32", "bfloat16"):
            if fw == "np" and dtype == "bfloat16":
                continue
            for shape in ((6,), (64, 80)):
                for op in (hvd.Average, hvd.Sum):
                    pre, post = (2.0, 3.0) if dtype.startswith("int") else (0.5, 4.0)
                    label = f"allreduce scaled {fw} {dtype} {shape} {op.name}"

                    @case(label)
                    def _():
                        x = make(values(r, shape, dtype), dtype, fw)
                        ref = reduce_ref([values(k, shape, dtype) for k in range(n)], op, dtype, pre, post)
                        got = hvd.allreduce(x, name=NAME + label, op=op, prescale_factor=pre,
                                            postscale_factor=post)
                        check_result(label, got, quantize(ref, dtype), dtype, fw)
                        check_result(label + " input untouched", x, values(r, shape, dtype), dtype, fw)
                        ret = hvd.allreduce_(x, name=NAME + label + "_", op=op, prescale_factor=pre,
                                             postscale_factor=post)
                        if ret is not x:
                            fail(f"{label}: allreduce_ did not return its argument")
                        check_result(label + " in place", x, quantize(ref, dtype), dtype, fw)

    # 64 KiB to 1 MiB on one host: through the shared-memory segment (backends/shm.py)
    from hvd_magic.collectives import state
    mpi = state.engine().mpi_backend      # (None under the gloo controller: no MPI)
    shm = mpi.shm if mpi is not None else None
    before = shm.calls if shm is not None else 0
    for fw, dtype in (("np", "float32"), ("np", "float64"), ("np", "int32"), ("torch", "float32")):
        for elems in (64 * 1024 // 4, 1024 * 1024 // 8):
            for op in OPS:
                label = f"allreduce shm {fw} {dtype} {elems} {op.name}"

                @case(label)
                def _():
                    kind = "product" if op == hvd.Product else "sum"
                    x = make(values(r, (elems,), dtype, kind), dtype, fw)
                    ref = quantize(reduce_ref([values(k, (elems,), dtype, kind) for k in range(n)],
                                              op, dtype), dtype)
                    check_result(label, hvd.allreduce(x, name=NAME + label, op=op), ref, dtype, fw)
                    check_result(label + " input untouched", x, values(r, (elems,), dtype, kind),
                                 dtype, fw)
                    hvd.allreduce_(x, name=NAME + label + "_", op=op)
                    check_result(label + " in place", x, ref, dtype, fw)
    if MODE in ("mpi", "nofusion") and (shm is None or shm.calls - before < 2 * 4 * 2 * len(OPS)):
        fail(f"allreduce shm: the segment carried {0 if shm is None else shm.calls - before} "
             "calls of 64 KiB to 1 MiB, expected all of them (one host)")

    # half types reduce in float32: big + n-1 ones, then *3, differs when accumulated in half
    for fw, dtype, big in (("np", "float16", 2048.0), ("torch", "float16", 2048.0),
                           ("torch", "bfloat16", 256.0)):
        for size in (3, 3000):
            label = f"half in float32 {fw} {dtype} {size}"

            @case(label)
            def _():
                x = make(np.full(size, big if r == 0 else 1.0), dtype, fw)
                exact = np.float32(big + (n - 1)) * np.float32(3)
                ref = quantize(np.full(size, exact, np.float64), dtype)
                got = hvd.allreduce(x, name=NAME + label, op=hvd.Sum, postscale_factor=3.0)
                check_result(label, got, ref, dtype, fw, exact=True)

    # integer Average rounds toward zero (as Horovod's), also for negative sums
    @case("int average toward zero")
    def _():
        x = np.array([r * 2 + 1, -(r * 2 + 1), 1 if r == 0 else 0, -1 if r == 0 else 0], dtype=np.int64)
        got = hvd.allreduce(x, name=NAME + "floor")
        s = np.array([sum(k * 2 + 1 for k in range(n)), -sum(k * 2 + 1 for k in range(n)), 1, -1])
        check_result("int average toward zero", got, np.trunc(s / n).astype(np.int64), "int64", "np")

    # bool: Min/Max/Product are logical; Sum/Average raise TypeError
    for fw in ("np", "torch"):
        for op in (hvd.Min, hvd.Max, hvd.Product):
            for shape in ((4,), (70, 70)):
                label = f"allreduce bool {fw} {op.name} {shape}"

                @case(label)
                def _():
                    def bits(k):
                        v = np.zeros(shape, dtype=bool).reshape(-1)
                        v[0] = True                      # all True
                        v[1] = (k == 0)                  # only rank 0
                        v[2] = False
                        v[3] = k % 2 == 1                # some
                        return v.reshape(shape)
                    x = bits(r) if fw == "np" else torch.from_numpy(bits(r))
                    allb = np.stack([bits(k) for k in range(n)])
                    ref = allb.any(0) if op == hvd.Max else allb.all(0)
                    got = hvd.allreduce(x, name=NAME + label, op=op)
                    check_result(label, got, ref, "bool", fw)
        for op in (hvd.Sum, hvd.Average):
            try:
                x = np.ones(3, bool) if fw == "np" else torch.ones(3, dtype=torch.bool)
                hvd.allreduce(x, name=NAME + f"boolsum{fw}{op}", op=op)
                fail(f"bool {op.name} {fw}: no TypeError")
            except TypeError:
                pass

    # non-contiguous inputs, out-of-place and in place
    for fw in ("np", "torch"):
        for big in (False, True):
            rows, cols = (64, 90) if big else (4, 6)
            label = f"noncontig {fw} big={big}"

            @case(label)
            def _():
                base = [values(k, (rows, cols), "float32").astype(np.float32) for k in range(n)]
                mine = base[r] if fw == "np" else torch.from_numpy(base[r].copy())
                x = mine[:, ::2] if fw == "np" else mine[:, ::2]
                xt = mine.T if fw == "np" else mine.t()
                ref = sum(b[:, ::2].astype(np.float64) for b in base) / n
                reft = sum(b.T.astype(np.float64) for b in base)
                check_result(label + " slice", hvd.allreduce(x, name=NAME + label + "a"), ref, "float32", fw)
                check_result(label + " T", hvd.allreduce(xt, name=NAME + label + "b", op=hvd.Sum), reft,
                             "float32", fw)
                # in place into a non-contiguous view: the parent must see it
                parent = (base[r].copy() if fw == "np" else torch.from_numpy(base[r].copy()))
                view = parent[:, ::2]
                ret = hvd.allreduce_(view, name=NAME + label + "c")
                if ret is not view:
                    fail(f"{label}: allreduce_ did not return its argument")
                check_result(label + " inplace view", parent[:, ::2], ref, "float32", fw)
                check_result(label + " untouched", parent[:, 1::2], base[r][:, 1::2].astype(np.float64),
                             "float32", fw)

    @case("requires_grad")
    def _():
        x = torch.full((3000,), float(r), requires_grad=True)
        for size in (3, 3000):
            got = hvd.allreduce(x[:size], name=NAME + f"grad{size}")
            check_result(f"requires_grad {size}", got, np.full(size, (n - 1) / 2), "float32", "torch")
            got = hvd.allgather(x[:size], name=NAME + f"gradg{size}")
            check_result(f"requires_grad gather {size}", got, np.repeat(np.arange(n), size).astype(float),
                         "float32", "torch")

    # in-place allreduce_ and allreduce_async_ on contiguous inputs, all dtypes
    for fw, dtypes in (("np", NP_DTYPES), ("torch", TORCH_DTYPES)):
        for dtype in dtypes:
            for shape in ((7,), (64, 80), ()):
                label = f"allreduce_ {fw} {dtype} {shape}"

                @case(label)
                def _():
                    x = make(values(r, shape, dtype), dtype, fw)
                    ref = quantize(reduce_ref([values(k, shape, dtype) for k in range(n)], hvd.Sum, dtype),
                                   dtype)
                    ret = hvd.allreduce_(x, name=NAME + label, op=hvd.Sum)
                    if ret is not x:
                        fail(f"{label}: did not return its argument")
                    check_result(label, x, ref, dtype, fw)
                    y = make(values(r, shape, dtype), dtype, fw)
                    h = hvd.allreduce_async_(y, name=NAME + label + "async", op=hvd.Max)
                    ref = quantize(reduce_ref([values(k, shape, dtype) for k in range(n)], hvd.Max, dtype),
                                   dtype)
                    ret = hvd.synchronize(h)
                    if ret is not y:
                        fail(f"{label} async: did not return its argument")
                    check_result(label + " async", y, ref, dtype, fw)

    # poll: True only once done; handle repr. A loop of polls must leave the engine thread
    # the GIL: when it did not, this 400 KB allreduce (in 1 KiB pieces, 3 ranks) took 6 s.
    @case("poll")
    def _():
        x = np.full(100000, float(r), np.float32)
        t0 = time.monotonic()
        h = hvd.allreduce_async(x, name=NAME + "poll")
        while not hvd.poll(h):
            pass
        if time.monotonic() - t0 > 1.0:
            fail(f"poll loop: the allreduce took {time.monotonic() - t0:.1f} s (the engine starved?)")
        check_result("poll", hvd.synchronize(h), np.full(100000, sum(range(n)) / n), "float32", "np")
        if not hvd.poll(h):
            fail("poll after synchronize is False")

    # grouped_allreduce (mixed dtypes and sizes), its in-place and async forms
    for fw in ("np", "torch"):
        @case(f"grouped {fw}")
        def _():
            specs = [("float32", (3,)), ("float32", (64, 80)), ("int64", (2, 2)), ("float16", (10,)),
                     ("float64", ())]
            if fw == "torch":
                specs.append(("bfloat16", (5,)))
            xs = [make(values(r, s, d), d, fw) for d, s in specs]
            refs = [quantize(reduce_ref([values(k, s, d) for k in range(n)], hvd.Average, d), d) for d, s in specs]
            got = hvd.grouped_allreduce(xs, name=NAME + "grouped" + fw)
            if len(got) != len(specs):
                fail(f"grouped {fw}: {len(got)} results")
            for (d, s), g, ref in zip(specs, got, refs):
                check_result(f"grouped {fw} {d} {s}", g, ref, d, fw)
            h = hvd.grouped_allreduce_async(xs, name=NAME + "groupedasync" + fw, op=hvd.Sum)
            refs_s = [quantize(reduce_ref([values(k, s, d) for k in range(n)], hvd.Sum, d), d) for d, s in specs]
            while not hvd.poll(h):
                pass
            got = hvd.synchronize(h)
            if len(got) != len(specs):
                fail(f"grouped async {fw}: {len(got)} results")
            for (d, s), g, ref in zip(specs, got, refs_s):
                check_result(f"grouped async {fw} {d} {s}", g, ref, d, fw)
            ys = [make(values(r, s, d), d, fw) for d, s in specs]
            got = hvd.synchronize(hvd.grouped_allreduce_async_(ys, name=NAME + "groupedasync_" + fw, op=hvd.Sum))
            for (d, s), y, g, ref in zip(specs, ys, got, refs_s):
                if g is not y:
                    fail(f"grouped_async_ {fw} {d}: result is not the input")
                check_result(f"grouped async_ {fw} {d} {s}", y, ref, d, fw)
            ret = hvd.grouped_allreduce_(xs, name=NAME + "grouped_" + fw, op=hvd.Max)
            refs_m = [quantize(reduce_ref([values(k, s, d) for k in range(n)], hvd.Max, d), d) for d, s in specs]
            for (d, s), x, g, ref in zip(specs, xs, ret, refs_m):
                if g is not x:
                    fail(f"grouped_ {fw} {d}: result is not the input")
                check_result(f"grouped_ {fw} {d} {s}", x, ref, d, fw)

    @case("grouped mixed frameworks")
    def _():
        # numpy and torch tensors of one dtype in one list, and an empty list
        xs = [np.full(3, float(r), np.float32), torch.full((2,), float(r)), np.full(2, r, np.int64)]
        got = hvd.grouped_allreduce(xs, name=NAME + "grouped mixed", op=hvd.Sum)
        s = sum(range(n))
        check_result("grouped mixed np", got[0], np.full(3, s), "float32", "np")
        check_result("grouped mixed torch", got[1], np.full(2, s), "float32", "torch")
        check_result("grouped mixed int", got[2], np.full(2, s), "int64", "np")
        if hvd.grouped_allreduce([], name=NAME + "grouped empty") != []:
            fail("grouped_allreduce([]) is not []")

    @case("grouped one dtype, not contiguous, big-endian")
    def _():
        # numpy arrays of one dtype are packed as bytes when every one is C-contiguous;
        # a transposed or strided member, or big-endian ones, take the general path
        s = sum(range(n))
        base = np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1)
        want = np.arange(12, dtype=np.float32).reshape(3, 4) * sum(range(1, n + 1))
        for label, xs, refs in [
                ("contiguous", [base.copy(), np.full(5, r, np.float32)], [want, np.full(5, s)]),
                ("transposed", [base.T, np.full(5, r, np.float32)], [want.T, np.full(5, s)]),
                ("strided", [np.full(5, r, np.float32), base[:, ::2]], [np.full(5, s), want[:, ::2]]),
                ("big-endian", [np.full(3, r, ">f4"), base.astype(">f4")], [np.full(3, s), want])]:
            got = hvd.grouped_allreduce(xs, name=NAME + "grouped " + label, op=hvd.Sum)
            for i, (g, ref) in enumerate(zip(got, refs)):
                if g.shape != ref.shape or not np.allclose(g, ref):
                    fail(f"grouped {label} {i}: {g} != {ref}")

    @case("big-endian numpy")
    def _():
        for size in (4, 3000):
            be = np.full(size, float(r + 1), dtype=">f8")
            got = hvd.allreduce(be, name=NAME + f"be{size}", op=hvd.Sum)
            if not np.allclose(got, sum(range(1, n + 1))):
                fail(f"big-endian allreduce {size}: {got[:2]}")
            hvd.allreduce_(be, name=NAME + f"be_{size}", op=hvd.Sum)
            if not np.allclose(be, sum(range(1, n + 1))):
                fail(f"big-endian allreduce_ {size}: {be[:2]}")
            got = hvd.allgather(np.full(2, r, dtype=">i4"), name=NAME + f"beg{size}")
            if not np.array_equal(got, np.repeat(np.arange(n), 2)):
                fail(f"big-endian allgather: {got}")

    # ------------------------------------------------------------ allgather
    for fw, dtypes in (("np", NP_DTYPES + ["bool"]), ("torch", TORCH_DTYPES + ["bool"])):
        for dtype in dtypes:
            label = f"allgather {fw} {dtype}"

            @case(label)
            def _():
                def inp(k, rows, tail=(3,)):
                    v = values(k, (rows,) + tail, dtype)
                    return (v > 0) if dtype == "bool" else v
                mk = (lambda v: make(v, dtype, fw)) if dtype != "bool" else \
                    (lambda v: np.asarray(v) if fw == "np" else torch.from_numpy(np.asarray(v)))
                # first dim differs by rank (rank k sends k+1 rows)
                got = hvd.allgather(mk(inp(r, r + 1)), name=NAME + label)
                ref = np.concatenate([inp(k, k + 1) for k in range(n)])
                check_result(label, got, quantize(ref, dtype) if dtype != "bool" else ref, dtype, fw)
                # rank 0 sends no rows
                got = hvd.allgather(mk(inp(r, 0 if r == 0 else 2, (2, 2))), name=NAME + label + "zero")
                ref = np.concatenate([inp(k, 0 if k == 0 else 2, (2, 2)) for k in range(n)])
                check_result(label + " zero rows", got, ref, dtype, fw)
                # 0-d: gathered as one row per rank
                got = hvd.allgather(mk(np.asarray(inp(r, 1, ())[0])), name=NAME + label + "0d")
                ref = np.concatenate([inp(k, 1, ()) for k in range(n)])
                check_result(label + " 0-d", got, ref, dtype, fw)
                # every rank sends no rows
                got = hvd.allgather(mk(inp(r, 0)), name=NAME + label + "allzero")
                check_result(label + " all zero rows", got, np.zeros((0, 3)), dtype, fw)
                # async + non-contiguous
                big = np.stack([inp(r, 4, (6,))] * 1)[0]
                t = mk(big)
                h = hvd.allgather_async(t[:, ::2], name=NAME + label + "nc")
                ref = np.concatenate([inp(k, 4, (6,))[:, ::2] for k in range(n)])
                check_result(label + " async noncontig", hvd.synchronize(h), ref, dtype, fw)

    # ------------------------------------------------------------ broadcast, each root
    for fw, dtypes in (("np", NP_DTYPES + ["bool"]), ("torch", TORCH_DTYPES + ["bool"])):
        for dtype in dtypes:
            for root in range(n):
                for shape in ((), (0, 2), (3, 4), (64, 80)):
                    label = f"broadcast {fw} {dtype} root={root} {shape}"

                    @case(label)
                    def _():
                        def inp(k):
                            v = values(k, shape, dtype)
                            return (v > 0) if dtype == "bool" else v
                        mk = (lambda v: make(v, dtype, fw)) if dtype != "bool" else \
                            (lambda v: np.asarray(v) if fw == "np" else torch.from_numpy(np.asarray(v)))
                        ref = inp(root)
                        x = mk(inp(r))
                        got = hvd.broadcast(x, root, name=NAME + label)
                        check_result(label, got, ref, dtype, fw, exact=True)
                        check_result(label + " input untouched", x, inp(r), dtype, fw, exact=True)
                        y = mk(inp(r))
                        ret = hvd.broadcast_(y, root_rank=root, name=NAME + label + "_")
                        if ret is not y:
                            fail(f"{label}: broadcast_ did not return its argument")
                        check_result(label + " in place", y, ref, dtype, fw, exact=True)
                        z = mk(inp(r))
                        h = hvd.broadcast_async_(z, root, name=NAME + label + "async_")
                        h2 = hvd.broadcast_async(mk(inp(r)), root, name=NAME + label + "async")
                        check_result(label + " async", hvd.synchronize(h2), ref, dtype, fw, exact=True)
                        hvd.synchronize(h)
                        check_result(label + " async_", z, ref, dtype, fw, exact=True)

    # broadcast_ into a non-contiguous view
    for fw in ("np", "torch"):
        for root in range(n):
            label = f"broadcast_ noncontig {fw} root={root}"

            @case(label)
            def _():
                base = [values(k, (5, 6), "float64") for k in range(n)]
                parent = base[r].copy() if fw == "np" else torch.from_numpy(base[r].copy())
                hvd.broadcast_(parent[:, 1::2], root, name=NAME + label)
                check_result(label, parent[:, 1::2], base[root][:, 1::2], "float64", fw, exact=True)
                check_result(label + " rest", parent[:, ::2], base[r][:, ::2], "float64", fw, exact=True)

    # ------------------------------------------------------------ alltoall
    for fw, dtypes in (("np", NP_DTYPES), ("torch", TORCH_DTYPES)):
        for dtype in dtypes:
            label = f"alltoall {fw} {dtype}"

            @case(label)
            def _():
                k_rows = 2
                data = [values(k, (n * k_rows, 3), dtype) for k in range(n)]
                got = hvd.alltoall(make(data[r], dtype, fw), name=NAME + label)
                ref = np.concatenate([data[k][r * k_rows:(r + 1) * k_rows] for k in range(n)])
                check_result(label, got, quantize(ref, dtype), dtype, fw, exact=True)
                # with splits: rank k sends (k + j) % 3 rows to rank j
                splits = [[(k + j) % 3 for j in range(n)] for k in range(n)]
                sd = [values(k, (sum(splits[k]), 2), dtype) for k in range(n)]
                sp = splits[r] if fw == "np" else torch.tensor(splits[r], dtype=torch.int32)
                res = hvd.alltoall(make(sd[r], dtype, fw), splits=sp, name=NAME + label + "splits")
                if not (isinstance(res, tuple) and len(res) == 2):
                    return fail(f"{label} splits: expected (output, received_splits), got {type(res)}")
                out, recv = res
                offs = [np.cumsum([0] + splits[k]) for k in range(n)]
                ref = np.concatenate([sd[k][offs[k][r]:offs[k][r + 1]] for k in range(n)]).reshape(-1, 2)
                check_result(label + " splits out", out, quantize(ref, dtype), dtype, fw, exact=True)
                exp = [splits[k][r] for k in range(n)]
                if fw == "torch" and not isinstance(recv, torch.Tensor):
                    fail(f"{label}: received_splits should be a torch tensor, got {type(recv)}")
                if list(np.asarray(to_np(recv)).tolist()) != exp:
                    fail(f"{label}: received_splits {recv} != {exp}")
                # async, without splits: plain output
                h = hvd.alltoall_async(make(data[r], dtype, fw), name=NAME + label + "async")
                ref = np.concatenate([data[k][r * k_rows:(r + 1) * k_rows] for k in range(n)])
                check_result(label + " async", hvd.synchronize(h), quantize(ref, dtype), dtype, fw, exact=True)

    # ------------------------------------------------------------ reducescatter
    for fw, dtypes in (("np", NP_DTYPES), ("torch", TORCH_DTYPES)):
        for dtype in dtypes:
            for rows in (1, 5, 2 * n, 64):
                for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max):
                    label = f"reducescatter {fw} {dtype} rows={rows} {op.name}"

                    @case(label)
                    def _():
                        shape = (rows, 3)
                        x = make(values(r, shape, dtype), dtype, fw)
                        full = reduce_ref([values(k, shape, dtype) for k in range(n)], op, dtype)
                        share = scatter_rows(rows, n)
                        start = sum(share[:r])
                        ref = quantize(full[start:start + share[r]], dtype)
                        if op == hvd.Sum:
                            h = hvd.reducescatter_async(x, name=NAME + label, op=op)
                            got = hvd.synchronize(h)
                        else:
                            got = hvd.reducescatter(x, name=NAME + label, op=op)
                        check_result(label, got, ref, dtype, fw)

    @case("reducescatter scaled")
    def _():
        x = values(r, (6, 2), "float64")
        full = reduce_ref([values(k, (6, 2), "float64") for k in range(n)], hvd.Sum, "float64", 0.5, 3.0)
        share = scatter_rows(6, n)
        start = sum(share[:r])
        got = hvd.reducescatter(x, name=NAME + "rs scaled", op=hvd.Sum, prescale_factor=0.5,
                                postscale_factor=3.0)
        check_result("reducescatter scaled", got, full[start:start + share[r]], "float64", "np")

    # ------------------------------------------------------------ barrier, objects
    @case("barrier")
    def _():
        for i in range(3):
            if hvd.barrier() is not None:
                fail("barrier returned something")
        hvd.barrier(name=NAME + "named barrier")

    @case("objects")
    def _():
        for root in range(n):
            obj = {"root": root, "from": r, "arr": np.arange(r + 1), "big": "x" * (20000 * (r + 1))}
            got = hvd.broadcast_object(obj if r == root else None, root_rank=root, name=NAME + f"bobj{root}")
            if got["from"] != root or got["root"] != root or len(got["big"]) != 20000 * (root + 1) \
                    or not np.array_equal(got["arr"], np.arange(root + 1)):
                fail(f"broadcast_object root={root}: got {str(got)[:80]}")
        got = hvd.broadcast_object([1, "two"])           # default root 0, unnamed
        if got != [1, "two"]:
            fail(f"broadcast_object default root: {got}")
        got = hvd.allgather_object({"rank": r, "pad": "y" * (r * 5000)}, name=NAME + "agobj")
        exp = [{"rank": k, "pad": "y" * (k * 5000)} for k in range(n)]
        if got != exp:
            fail(f"allgather_object: {str(got)[:100]}")
        got = hvd.allgather_object(None)
        if got != [None] * n:
            fail(f"allgather_object None: {got}")


def main():
    global MODE
    # "gloo": CPU tensors through torch.distributed, the code path CUDA tensors take with NCCL
    for mode, env in (("mpi", {}), ("nofusion", {"HOROVOD_FUSION_THRESHOLD": "0"}),
                      # every allreduce over 1048 bytes as MPI calls of 1048 bytes
                      # (boundaries inside tensors and fusion buffers)
                      ("chunks", {"HVD_MAGIC_ALLREDUCE_CHUNK_MB": "0.001"}),
                      ("gloo", {"HOROVOD_CPU_OPERATIONS": "gloo"})):
        if len(sys.argv) > 1 and mode not in sys.argv[1:]:
            continue
        MODE = mode
        for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CPU_OPERATIONS",
                  "HVD_MAGIC_ALLREDUCE_CHUNK_MB"):
            os.environ.pop(k, None)
        os.environ.update(env)
        t0 = time.time()
        hvd.init()
        try:
            run_all()
        finally:
            t1 = time.time()
            hvd.shutdown()
        if os.environ.get("COLL_TIMING"):
            print(f"{mode}: init+run {t1 - t0:.2f} s, shutdown {time.time() - t1:.2f} s", flush=True)
    r = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    if FAILS:
        for f in FAILS:
            print(f"rank {r}: FAIL {f}", file=sys.stderr)
        print(f"rank {r}: {len(FAILS)} failures", file=sys.stderr)
        sys.exit(1)
    print(f"rank {r}: coll_ops OK")


if __name__ == "__main__":
    main()
