"""hvd_magic.mxnet under real MPI (2 or 3 ranks), in .venv-mxnet: every collective and
dtype against numpy references, process sets, the object ops, Compression, broadcast_parameters
(deferred initialisation included), DistributedTrainer and DistributedOptimizer against one
process training on the whole batch, and mismatches across ranks failing with a clear error
on every rank (never a hang).

Usage: mpiexec -n N .venv-mxnet/bin/python mxnet_checks.py
Exits nonzero with one line per failed check, prefixed by the rank."""
import os
import sys
import warnings

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs
os.environ.setdefault("MXNET_ENGINE_TYPE", "NaiveEngine")            # 1 thread: 2 cores, 3 ranks
sys.path.insert(0, os.path.dirname(__file__))

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.base import MXNetError  # noqa: E402

import hvd_magic.collectives as C  # noqa: E402
import hvd_magic.mxnet as hvd  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

hvd.init(process_sets="dynamic")
R, N = hvd.rank(), hvd.size()
DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]


def nd(a, dtype):
    return mx.nd.array(np.asarray(a), dtype=dtype)


def expect(label, cls, fn, *words):
    """fn() raises cls (and MXNetError, as Horovod's ops do) naming every word."""
    try:
        fn()
    except cls as exc:
        if not isinstance(exc, MXNetError):
            FAILS.append(f"{label}: {type(exc).__name__} is not an MXNetError")
        missing = [w for w in words if w not in str(exc)]
        if missing:
            FAILS.append(f"{label}: message lacks {missing}: {exc}")
    except Exception as exc:      # noqa: BLE001
        FAILS.append(f"{label}: raised {type(exc).__name__} instead of {cls.__name__}: {exc}")
    else:
        FAILS.append(f"{label}: no error")


@check("allreduce every op and dtype")
def _():
    for dt in DTYPES:
        base = np.arange(1, 7).reshape(2, 3)
        mine = base + R
        every = [base + r for r in range(N)]
        close(f"sum {dt}", hvd.allreduce(nd(mine, dt), op=hvd.Sum, name=f"s.{dt}").asnumpy(),
              np.sum(every, axis=0).astype(dt))
        close(f"min {dt}", hvd.allreduce(nd(mine, dt), op=hvd.Min, name=f"mi.{dt}").asnumpy(), base)
        close(f"max {dt}", hvd.allreduce(nd(mine, dt), op=hvd.Max, name=f"ma.{dt}").asnumpy(), base + N - 1)
        if dt not in ("uint8", "int8"):      # (the product overflows 8 bits)
            close(f"prod {dt}", hvd.allreduce(nd(mine, dt), op=hvd.Product, name=f"p.{dt}").asnumpy(),
                  np.prod(every, axis=0).astype(dt), atol=1e-3 * np.prod(every).max())
        avg = hvd.allreduce(nd(mine, dt), name=f"a.{dt}")
        if avg.dtype != np.dtype(dt):
            FAILS.append(f"average {dt}: came back {avg.dtype}")
        close(f"avg {dt}", avg.asnumpy(), np.mean(every, axis=0), atol=1.0)
        t = nd(mine, dt)
        out = hvd.allreduce_(t, op=hvd.Sum, name=f"ip.{dt}")
        if out is not t:
            FAILS.append(f"allreduce_ {dt}: did not return its input")
        close(f"inplace {dt}", t.asnumpy(), np.sum(every, axis=0).astype(dt))
    scaled = hvd.allreduce(mx.nd.ones(3), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    close("pre/postscale", scaled.asnumpy(), np.full(3, N))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        close("average=False (deprecated)", hvd.allreduce(mx.nd.ones(2), average=False).asnumpy(), [N, N])
    close("adasum", hvd.allreduce(mx.nd.ones(4), op=hvd.Adasum).asnumpy(), np.ones(4))
    close("scalar", hvd.allreduce(mx.nd.array(float(R)), op=hvd.Sum).asnumpy(), sum(range(N)))


@check("grouped allreduce, allgather, reducescatter")
def _():
    ins = [nd([R, 1], "float32"), nd([[R]], "int64")]
    outs = hvd.grouped_allreduce(ins, op=hvd.Sum, name="g")
    close("grouped sum 0", outs[0].asnumpy(), [sum(range(N)), N])
    close("grouped sum 1", outs[1].asnumpy(), [[sum(range(N))]])
    hvd.grouped_allreduce_(ins, op=hvd.Max, name="g_")
    close("grouped_ max", ins[0].asnumpy(), [N - 1, 1])
    g = hvd.allgather(nd(np.full((R + 1, 2), R), "int32"))
    close("allgather variable rows", g.asnumpy(), np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    ga = hvd.grouped_allgather([nd([R], "float16"), nd([R, R], "uint8")])
    close("grouped allgather 0", ga[0].asnumpy(), list(range(N)))
    close("grouped allgather 1", ga[1].asnumpy(), [r for r in range(N) for _ in (0, 1)])
    rs = hvd.reducescatter(nd(np.arange(2 * N), "float64"), op=hvd.Sum)
    close("reducescatter", rs.asnumpy(), N * np.arange(2 * N)[2 * R:2 * R + 2])
    grs = hvd.grouped_reducescatter([nd(np.arange(N), "int32"), mx.nd.ones((N, 2))], op=hvd.Average)
    close("grouped reducescatter 0", grs[0].asnumpy(), [R])
    close("grouped reducescatter 1", grs[1].asnumpy(), [[1, 1]])


@check("broadcast and alltoall")
def _():
    for dt in DTYPES:
        for root in range(N):
            b = hvd.broadcast(nd([R + 1, 2], dt), root_rank=root, name=f"b.{dt}.{root}")
            close(f"broadcast {dt} root {root}", b.asnumpy(), [root + 1, 2])
    t = nd([R, R], "float32")
    if hvd.broadcast_(t, root_rank=N - 1) is not t:
        FAILS.append("broadcast_: did not return its input")
    close("broadcast_", t.asnumpy(), [N - 1, N - 1])
    a = hvd.alltoall(nd(np.arange(N) + 10 * R, "int64"))
    close("alltoall equal", a.asnumpy(), [10 * r + R for r in range(N)])
    splits = [1 if j == R else 0 for j in range(N)]        # one row to myself only
    out, recv = hvd.alltoall(nd([[R, R]], "float32"), splits=mx.nd.array(splits, dtype="int32"))
    close("alltoall splits out", out.asnumpy(), [[R, R]])
    if recv.dtype != np.int32:
        FAILS.append(f"alltoall received splits dtype {recv.dtype}")
    close("alltoall splits received", recv.asnumpy(), splits)


@check("process sets")
def _():
    evens = hvd.add_process_set([r for r in range(N) if r % 2 == 0])
    if evens.included():
        s = hvd.allreduce(nd([1], "int32"), op=hvd.Sum, process_set=evens)
        close("allreduce on evens", s.asnumpy(), [evens.size()])
        g = hvd.allgather(nd([R], "int32"), process_set=evens)
        close("allgather on evens", g.asnumpy(), list(range(0, N, 2)))
        b = hvd.broadcast(nd([R], "float32"), root_rank=0, process_set=evens)
        close("broadcast on evens", b.asnumpy(), [0])
    hvd.remove_process_set(evens)


@check("objects, compression, queries")
def _():
    if hvd.broadcast_object({"r": R} if R == 0 else None, root_rank=0) != {"r": 0}:
        FAILS.append("broadcast_object")
    if hvd.allgather_object(R * 2) != [2 * r for r in range(N)]:
        FAILS.append("allgather_object")
    c, ctx = hvd.Compression.fp16.compress(mx.nd.ones(3))
    if c.dtype != np.float16 or hvd.Compression.fp16.decompress(c, ctx).dtype != np.float32:
        FAILS.append("fp16 compression dtypes")
    i, ctx = hvd.Compression.fp16.compress(mx.nd.ones(3, dtype="int32"))
    if i.dtype != np.int32:
        FAILS.append("fp16 compression cast an int32 NDArray")
    if not (hvd.mpi_built() and hvd.mpi_enabled() and hvd.is_initialized()) or hvd.nccl_built():
        FAILS.append("the *_built/*_enabled queries")


def mismatch_checks():
    shape = (2,) if R == 0 else (3,)
    expect("shape mismatch", hvd.TensorMismatchError,
           lambda: hvd.allreduce(mx.nd.ones(shape), name="mm.shape"), "mm.shape", "rank 0 sent (2,)", "1")
    dtype = "float32" if R == 0 else "int32"
    expect("dtype mismatch", hvd.TensorMismatchError,
           lambda: hvd.allreduce(mx.nd.ones(2, dtype=dtype), name="mm.dtype"), "mm.dtype", "float32", "int32")
    expect("broadcast root mismatch", hvd.TensorMismatchError,
           lambda: hvd.broadcast(mx.nd.ones(2), root_rank=R, name="mm.root"), "mm.root")
    expect("bool not supported", TypeError, lambda: hvd.allreduce(mx.nd.ones(2, dtype="bool")), "bool")
    expect("not an NDArray", TypeError, lambda: hvd.allreduce(np.ones(2)), "NDArray")
    expect("reducescatter of a scalar", ValueError, lambda: hvd.reducescatter(mx.nd.array(1.0)))
    expect("float32 splits", ValueError,
           lambda: hvd.alltoall(mx.nd.ones(N), splits=mx.nd.ones(N)), "int32")


check("mismatches fail on every rank, naming tensor and ranks")(mismatch_checks)


# ---------------------------------------------------------------- training against one process

def make_net(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="tanh"), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())    # deferred: shapes known at first forward
    return net


rng = np.random.RandomState(0)
X = rng.randn(12 * N, 5).astype(np.float32)
Y = rng.randint(0, 3, size=12 * N).astype(np.float32)
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
STEPS = 4


def train(net, step_fn, x, y):
    for _ in range(STEPS):
        with autograd.record():
            loss = LOSS(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        step_fn(x.shape[0])
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]


def reference(opt, opt_params):
    """One process (this one, no collectives) training on the whole batch."""
    net = make_net(123)
    trainer = gluon.Trainer(net.collect_params(), opt, dict(opt_params), kvstore=None)
    return train(net, trainer.step, X, Y)


def shard():
    rows = slice(12 * R, 12 * (R + 1))
    return X[rows], Y[rows]


@check("broadcast_parameters (deferred) + DistributedTrainer == one process on the whole batch")
def _():
    net = make_net(1000 + R)                         # every rank starts from different weights
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="t.")
    net(mx.nd.array(X[:1]))                         # first forward: initialised, then broadcast
    ref_net = make_net(123)
    ref_net(mx.nd.array(X[:1]))
    w0 = [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]
    every = hvd.allgather_object(w0)
    for i, w in enumerate(w0):
        for r in range(N):
            close(f"broadcast_parameters param {i} rank {r}", every[r][i], w)
    # start the reference from the same (root's) weights
    for (_, p), w in zip(sorted(ref_net.collect_params().items()), w0):
        p.set_data(mx.nd.array(w))
    trainer = gluon.Trainer(ref_net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                            kvstore=None)
    want = train(ref_net, trainer.step, X, Y)
    for kw in ({}, {"gradient_predivide_factor": 2.0}, {"num_groups": 2},
               {"compression": hvd.Compression.fp16}):
        net2 = make_net(7 + R)
        net2(mx.nd.array(X[:1]))
        for (_, p), w in zip(sorted(net2.collect_params().items()), w0):
            p.set_data(mx.nd.array(w))
        dt = hvd.DistributedTrainer(net2.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                                    prefix=f"dt{sorted(kw)}.", **kw)
        got = train(net2, dt.step, *shard())
        atol = 2e-3 if "compression" in kw else 1e-5
        for i, (g, w) in enumerate(zip(got, want)):
            close(f"DistributedTrainer {kw} param {i}", g, w, atol=atol)


@check("DistributedOptimizer == one process on the whole batch")
def _():
    w = mx.nd.array(np.linspace(-1, 1, 6).reshape(2, 3))
    full_grad = np.arange(6 * N, dtype=np.float32).reshape(N, 2, 3)   # rank r's gradient: full_grad[r]
    ref = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)
    w_ref = w.copy()
    st = ref.create_state(0, w_ref)
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    w_mine = w.copy()
    st2 = opt.create_state(0, w_mine)
    for _ in range(3):
        ref.update(0, w_ref, mx.nd.array(full_grad.mean(axis=0)), st)
        opt.update(0, w_mine, mx.nd.array(full_grad[R]), st2)
    close("DistributedOptimizer weights", w_mine.asnumpy(), w_ref.asnumpy(), atol=1e-5)
    if opt.learning_rate != 0.1:
        FAILS.append("DistributedOptimizer does not show the wrapped optimizer's attributes")
    # as the optimizer of a gluon Trainer (kvstore=None: the update does the allreduce)
    net = make_net(5)
    net(mx.nd.array(X[:1]))
    w0 = hvd.broadcast_object([p.data().asnumpy() for _, p in sorted(net.collect_params().items())])
    for (_, p), v in zip(sorted(net.collect_params().items()), w0):
        p.set_data(mx.nd.array(v))
    ref_net = make_net(6)
    ref_net(mx.nd.array(X[:1]))
    for (_, p), v in zip(sorted(ref_net.collect_params().items()), w0):
        p.set_data(mx.nd.array(v))
    want = train(ref_net, gluon.Trainer(ref_net.collect_params(), "sgd", {"learning_rate": 0.3},
                                        kvstore=None).step, X, Y)
    dopt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.3))
    got = train(net, gluon.Trainer(net.collect_params(), dopt, kvstore=None).step, *shard())
    for i, (g, v) in enumerate(zip(got, want)):
        close(f"Trainer(DistributedOptimizer) param {i}", g, v, atol=1e-5)


finish(C)      # (horovod.mxnet has no barrier: the runtime's)
