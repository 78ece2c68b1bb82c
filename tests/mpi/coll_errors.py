"""Every mismatch raises hvd.TensorMismatchError on EVERY rank, with a message naming the op,
the tensor and the differing values with their ranks; the runtime stays usable afterwards.
Also local argument errors (raised before anything is sent).

Exits nonzero with one line per failed check, prefixed by the rank."""
import sys
import traceback

import numpy as np

import hvd_magic.collectives as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
FAILS = []


def fail(msg):
    FAILS.append(msg)


def ranks_text(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def others(k):
    return [j for j in range(n) if j != k]


def expect_mismatch(label, submit, must_contain):
    """submit() -> result or handle; every rank must raise TensorMismatchError."""
    try:
        res = submit()
        if isinstance(res, hvd.Handle):
            hvd.synchronize(res)
        fail(f"{label}: no error on rank {r}")
        return
    except hvd.TensorMismatchError as e:
        msg = str(e)
        if not isinstance(e, RuntimeError):
            fail(f"{label}: TensorMismatchError is not a RuntimeError")
        for s in must_contain:
            if s not in msg:
                fail(f"{label}: message lacks {s!r}: {msg}")
    except Exception:
        fail(f"{label}: wrong exception\n{traceback.format_exc()}")
    # still usable: a correct collective right after
    try:
        got = hvd.allreduce(np.full(3, float(r)), name=f"after {label}")
        if not np.allclose(got, (n - 1) / 2):
            fail(f"{label}: allreduce afterwards gave {got}")
    except Exception:
        fail(f"{label}: allreduce afterwards raised\n{traceback.format_exc()}")


odd = n - 1          # the rank that differs
rest = ranks_text(others(odd))
me = ranks_text([odd])

for size in (3, 3000):   # a small and a bigger tensor
    sfx = f" {size}"
    expect_mismatch("shape" + sfx, lambda: hvd.allreduce(np.zeros(size + (r == odd)), name="t.shape" + sfx),
                    ["allreduce", "'t.shape" + sfx + "'", "shape", f"{me} sent ({size + 1},)",
                     f"{rest} sent ({size},)"])
    expect_mismatch("dtype" + sfx,
                    lambda: hvd.allreduce(np.zeros(size, np.float64 if r == odd else np.float32),
                                          name="t.dtype" + sfx),
                    ["allreduce", "'t.dtype" + sfx + "'", "dtype", f"{me} sent 'float64'",
                     f"{rest} sent 'float32'"])
    expect_mismatch("op" + sfx,
                    lambda: hvd.allreduce(np.zeros(size), name="t.op" + sfx, op=hvd.Sum if r == odd else hvd.Max),
                    ["allreduce", "'t.op" + sfx + "'", "op", f"{me} sent 'Sum'", f"{rest} sent 'Max'"])
    expect_mismatch("prescale" + sfx,
                    lambda: hvd.allreduce(np.zeros(size), name="t.pre" + sfx,
                                          prescale_factor=2.0 if r == odd else 1.0),
                    ["allreduce", "'t.pre" + sfx + "'", "prescale_factor", f"{me} sent 2.0", f"{rest} sent 1.0"])
    expect_mismatch("postscale" + sfx,
                    lambda: hvd.allreduce_async(np.zeros(size), name="t.post" + sfx,
                                                postscale_factor=0.5 if r == odd else 1.0),
                    ["allreduce", "'t.post" + sfx + "'", "postscale_factor", f"{me} sent 0.5",
                     f"{rest} sent 1.0"])

expect_mismatch("broadcast root", lambda: hvd.broadcast(np.zeros(4), root_rank=1 if r == odd else 0, name="t.root"),
                ["broadcast", "'t.root'", "root_rank", f"{me} sent 1", f"{rest} sent 0"])
expect_mismatch("broadcast shape", lambda: hvd.broadcast_(np.zeros(4 + (r == odd)), 0, name="t.bshape"),
                ["broadcast", "'t.bshape'", "shape", f"{me} sent (5,)"])
expect_mismatch("broadcast dtype", lambda: hvd.broadcast(np.zeros(4, np.int32 if r == odd else np.int64), 0,
                                                         name="t.bdtype"),
                ["broadcast", "'t.bdtype'", "dtype", f"{me} sent 'int32'", f"{rest} sent 'int64'"])
expect_mismatch("broadcast_object root",
                lambda: hvd.broadcast_object("x", root_rank=1 if r == odd else 0, name="t.oroot"),
                ["broadcast_object", "'t.oroot'", "root_rank", f"{me} sent 1"])
expect_mismatch("allgather trailing",
                lambda: hvd.allgather(np.zeros((r + 1, 3 + (r == odd))), name="t.gtail"),
                ["allgather", "'t.gtail'", "all but the first dimension", f"{me} sent (4,)",
                 f"{rest} sent (3,)"])
expect_mismatch("allgather dtype",
                lambda: hvd.allgather(np.zeros((2, 2), np.uint8 if r == odd else np.int8), name="t.gdtype"),
                ["allgather", "'t.gdtype'", "dtype", f"{me} sent 'uint8'"])
expect_mismatch("alltoall trailing",
                lambda: hvd.alltoall(np.zeros((n, 2 + (r == odd))), name="t.a2a"),
                ["alltoall", "'t.a2a'", f"{me} sent (3,)"])
expect_mismatch("reducescatter shape",
                lambda: hvd.reducescatter(np.zeros((n + (r == odd), 2)), name="t.rs"),
                ["reducescatter", "'t.rs'", "shape"])
expect_mismatch("reducescatter op",
                lambda: hvd.reducescatter(np.zeros((n, 2)), name="t.rsop", op=hvd.Sum if r == odd else hvd.Average),
                ["reducescatter", "'t.rsop'", "op", f"{me} sent 'Sum'"])


def kinds():
    if r == odd:
        return hvd.allgather(np.zeros(3), name="t.kinds")
    return hvd.allreduce(np.zeros(3), name="t.kinds")


expect_mismatch("different op kinds", kinds,
                ["'t.kinds'", "different operations", f"{me} sent 'allgather'", f"{rest} sent 'allreduce'"])


# mismatches found while ranks submit in different orders (general negotiation path)
def late():
    hs = []
    order = ["m0", "m1"] if r % 2 == 0 else ["m1", "m0"]
    for nm in order:
        hs.append((nm, hvd.allreduce_async(np.zeros(3000 if nm == "m1" else 3 + (r == odd)), name=nm)))
    errs = {}
    for nm, h in hs:
        try:
            hvd.synchronize(h)
        except hvd.TensorMismatchError as e:
            errs[nm] = str(e)
    if set(errs) != {"m0"} or "'m0'" not in errs["m0"]:
        fail(f"orders + mismatch: errors {errs}")


try:
    late()
except Exception:
    fail(f"orders + mismatch raised\n{traceback.format_exc()}")

# ---------------------------------------------------------------- local errors
def expect(exc, fn, label, contains=()):
    try:
        fn()
        fail(f"{label}: no {exc.__name__}")
    except exc as e:
        for s in contains:
            if s not in str(e):
                fail(f"{label}: message lacks {s!r}: {e}")
    except Exception:
        fail(f"{label}: wrong exception\n{traceback.format_exc()}")


h = hvd.allreduce_async(np.ones(5), name="busy")
expect(ValueError, lambda: hvd.allreduce_async(np.ones(5), name="busy"), "in flight", ["busy", "in flight"])
expect(ValueError, lambda: hvd.allgather(np.ones(5), name="busy"), "in flight other kind", ["busy"])
hvd.synchronize(h)
expect(TypeError, lambda: hvd.allreduce([1, 2]), "list input")
expect(TypeError, lambda: hvd.allreduce(np.ones(2, bool), op=hvd.Sum), "bool sum")
expect(TypeError, lambda: hvd.allreduce(np.ones(2, bool)), "bool average")
expect(TypeError, lambda: hvd.allreduce(np.ones(2, np.complex64)), "complex")
expect(ValueError, lambda: hvd.allreduce(np.ones(2), op="nope"), "bad op")
expect(ValueError, lambda: hvd.broadcast(np.ones(2), root_rank=n), "root out of range", [str(n)])
expect(TypeError, lambda: hvd.broadcast(np.ones(2), root_rank=0.5), "root float")
expect(ValueError, lambda: hvd.alltoall(np.ones(n + 1)) if n > 1 else (_ for _ in ()).throw(ValueError()),
       "alltoall indivisible")
expect(ValueError, lambda: hvd.alltoall(np.ones(4), splits=[4] + [1] * (n - 1)), "alltoall bad splits")
expect(ValueError, lambda: hvd.alltoall(np.ones(())), "alltoall 0-d")
expect(ValueError, lambda: hvd.reducescatter(np.ones(())), "reducescatter 0-d")
expect(TypeError, lambda: hvd.poll(object()), "poll non-handle")
expect(TypeError, lambda: hvd.synchronize(3), "synchronize non-handle")

# still usable at the end
if not np.allclose(hvd.allreduce(np.full(2, float(r)), name="end"), (n - 1) / 2):
    fail("final allreduce")
hvd.shutdown()

if FAILS:
    for f in FAILS:
        print(f"rank {r}: FAIL {f}", file=sys.stderr)
    print(f"rank {r}: {len(FAILS)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {r}: coll_errors OK")
