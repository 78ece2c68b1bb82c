"""op=hvd.Adasum under real MPI, against reference_adasum computed from every rank's known
inputs: numpy float16/32/64 and torch tensors (bfloat16 too), many lengths (0, fewer than
the ranks, odd, > one float64 conversion chunk), in and out of place, async with other ops
around, scaled, with a joined rank; identical bytes on every rank; integer -> ValueError;
DistributedOptimizer(op=Adasum); the error through torch.distributed (gloo, the path of
CUDA tensors). With the argument ``tf``: DistributedGradientTape(op=Adasum)
instead (eager and tf.function).

Exits nonzero with one line per failed check, prefixed by the rank."""
import hashlib
import os
import sys
import traceback

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")   # a bug fails, never hangs

import numpy as np  # noqa: E402

from hvd_magic.collectives.adasum import reference_adasum  # noqa: E402

FAILS = []


def fail(msg):
    FAILS.append(msg)


def case(label):
    def deco(fn):
        try:
            fn()
        except Exception:
            fail(f"{label}: raised\n{traceback.format_exc()}")
        return fn
    return deco


def vec(rank, shape, seed):
    """Rank ``rank``'s input (float64): random, plus a shared part so vectors correlate."""
    n = int(np.prod(shape)) if shape else 1
    common = np.random.default_rng(seed).standard_normal(n)
    own = np.random.default_rng(seed * 1000 + rank + 1).standard_normal(n)
    return (0.7 * common + own).reshape(shape)


TOL = {"float64": (1e-10, 1e-12), "float32": (2e-5, 1e-6), "float16": (2e-2, 2e-2),
       "bfloat16": (5e-2, 5e-2)}


def digest(x):
    import torch
    if isinstance(x, torch.Tensor):
        x = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        x = x.numpy()
    return hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest()


def run_collectives(hvd, torch):
    r, n = hvd.rank(), hvd.size()
    shapes = [(), (0,), (1,), (2,), (3,), (5,), (17,), (3, 4), (1001,), (70001,)]
    seen = []                  # (label, digest) of every result, compared across ranks at the end

    def check(label, got, shape, dtype, seed, scale=1.0, fw="np"):
        ref = scale * reference_adasum([vec(k, shape, seed) for k in range(n)])
        if fw == "np" and not isinstance(got, np.ndarray):
            return fail(f"{label}: expected numpy, got {type(got).__name__}")
        if fw == "torch" and not isinstance(got, torch.Tensor):
            return fail(f"{label}: expected torch, got {type(got).__name__}")
        if str(got.dtype).replace("torch.", "") != dtype or tuple(got.shape) != tuple(shape):
            return fail(f"{label}: got {got.dtype} {tuple(got.shape)}")
        g = got.double().numpy() if fw == "torch" else got
        rtol, atol = TOL[dtype]
        if not np.allclose(np.asarray(g, np.float64), ref, rtol=rtol, atol=atol):
            return fail(f"{label}: values differ\n   got {np.asarray(g).reshape(-1)[:6]}\n"
                        f"   ref {ref.reshape(-1)[:6]}")
        seen.append((label, digest(got)))

    def make(shape, dtype, seed, fw):
        v = vec(r, shape, seed)
        if fw == "np":
            return np.asarray(v).astype(dtype)
        return torch.tensor(np.asarray(v, np.float64)).to(getattr(torch, dtype))

    seed = 0
    for fw, dtypes in (("np", ("float32", "float64", "float16")),
                       ("torch", ("float32", "float64", "float16", "bfloat16"))):
        for dtype in dtypes:
            handles = []
            for shape in shapes:
                seed += 1
                label = f"{fw} {dtype} {shape}"

                @case(label)
                def _():
                    x = make(shape, dtype, seed, fw)
                    x0 = x.copy() if fw == "np" else x.clone()
                    got = hvd.allreduce(x, name=label, op=hvd.Adasum)
                    check(label, got, shape, dtype, seed, fw=fw)
                    same = np.array_equal(x, x0) if fw == "np" else torch.equal(x, x0)
                    if not same:
                        fail(f"{label}: the input changed")
                    ret = hvd.allreduce_(x, name=label + " in place", op=hvd.Adasum)
                    if ret is not x:
                        fail(f"{label}: allreduce_ did not return its argument")
                    check(label + " in place", x, shape, dtype, seed, fw=fw)
                    # async, between Average requests: Adasum buckets stay apart
                    y = make(shape, dtype, seed, fw)
                    handles.append((label, hvd.allreduce_async(y, name=label + " async",
                                                               op=hvd.Adasum), shape, seed))
                    handles.append((None, hvd.allreduce_async(make(shape, dtype, seed, fw),
                                                              name=label + " avg"), shape, seed))
            for label, h, shape, sd in handles:
                try:
                    got = hvd.synchronize(h)
                    if label is not None:
                        check(label + " async", got, shape, dtype, sd, fw=fw)
                    elif not np.allclose(np.asarray(got if fw == "np" else got.float(), np.float64),
                                         np.mean([vec(k, shape, sd) for k in range(n)], axis=0),
                                         rtol=2e-2, atol=2e-2):
                        fail(f"average between Adasum requests {shape} {dtype}: wrong")
                except Exception:
                    fail(f"async {label}: raised\n{traceback.format_exc()}")

    @case("scaled")
    def _():
        for dtype in ("float32", "float64", "float16"):
            x = make((9,), dtype, 500, "np")
            got = hvd.allreduce(x, name=f"scaled {dtype}", op=hvd.Adasum, prescale_factor=0.5,
                                postscale_factor=3.0)
            check(f"scaled {dtype}", got, (9,), dtype, 500, scale=1.5)

    @case("equal inputs")
    def _():
        v = np.linspace(-1, 1, 11)
        got = hvd.allreduce(v.copy(), name="equal", op=hvd.Adasum)
        if not np.allclose(got, v, rtol=1e-12):
            fail(f"Adasum of equal vectors is not the vector: {got[:3]}")
        e = np.zeros(n)
        e[r] = r + 1.0
        got = hvd.allreduce(e, name="orthogonal", op=hvd.Adasum)
        if not np.allclose(got, np.arange(1.0, n + 1)):
            fail(f"Adasum of orthogonal vectors is not their sum: {got}")

    @case("grouped, per tensor")
    def _():
        a, b = vec(r, (5,), 700), vec(r, (3,), 701)
        ga, gb = hvd.grouped_allreduce([a, b], name="grouped adasum", op=hvd.Adasum)
        for label, got, seed, size in (("a", ga, 700, 5), ("b", gb, 701, 3)):
            ref = reference_adasum([vec(k, (size,), seed) for k in range(n)])
            if not np.allclose(got, ref, rtol=1e-10):
                fail(f"grouped Adasum tensor {label} is not its own Adasum: {got[:3]} != {ref[:3]}")
        try:
            hvd.reducescatter(np.ones(2 * n), op=hvd.Adasum)
            fail("reducescatter(op=Adasum): no error")
        except ValueError as e:
            if "Adasum" not in str(e):
                fail(f"unclear reducescatter message: {e}")

    @case("integer dtypes")
    def _():
        for dtype in ("int32", "int64", "uint8", "bool"):
            try:
                hvd.allreduce(np.ones(3, dtype=dtype), name=f"int {dtype}", op=hvd.Adasum)
                fail(f"Adasum of {dtype}: no error")
            except ValueError as e:
                if "Adasum" not in str(e) or dtype not in str(e):
                    fail(f"Adasum of {dtype}: message does not name Adasum and {dtype}: {e}")
        try:
            hvd.allreduce(torch.ones(3, dtype=torch.int32), name="int torch", op=hvd.Adasum)
            fail("Adasum of a torch int32 tensor: no error")
        except ValueError as e:
            if "Adasum" not in str(e):
                fail(f"unclear message: {e}")
        # still in step afterwards
        if not np.allclose(hvd.allreduce(np.ones(2), name="after int"), 1.0):
            fail("allreduce after the int errors")

    @case("joined rank")
    def _():
        # the last rank joins; the others' Adasum runs with zeros in its place
        if r == n - 1:
            hvd.join()
        else:
            x = vec(r, (6,), 900)
            got = hvd.allreduce(x, name="adasum with joined", op=hvd.Adasum)
            ref = reference_adasum([vec(k, (6,), 900) if k < n - 1 else np.zeros(6) for k in range(n)])
            if not np.allclose(got, ref, rtol=1e-10):
                fail(f"Adasum with a joined rank: {got[:3]} != {ref[:3]}")
            hvd.join()

    # every rank holds identical bytes for every result
    @case("identical results")
    def _():
        everyone = hvd.allgather_object(seen, name="adasum digests")
        for k, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = [a for a, b in zip(theirs, everyone[0]) if a != b][:3]
                fail(f"rank {k}'s results differ from rank 0's: {diff}")
        if len(seen) < 100:
            fail(f"only {len(seen)} results were checked")


def run_optimizer():
    import torch
    import hvd_magic.torch as hvd
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)

    @case("DistributedOptimizer(op=Adasum): one SGD step")
    def _():
        m = torch.nn.Linear(4, 1, bias=True).double()
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(), op=hvd.Adasum)
        before = {k: v.detach().clone() for k, v in m.named_parameters()}
        g = torch.Generator().manual_seed(10 + r)
        x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 1, generator=g,
                                                                               dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        grads = {k: v.grad.numpy().copy() for k, v in m.named_parameters()}
        all_grads = hvd.allgather_object(grads, name="grads")
        opt.step()
        for k, p in m.named_parameters():
            ref = before[k].numpy() + reference_adasum([-0.1 * gr[k] for gr in all_grads])
            if not np.allclose(p.detach().numpy(), ref, rtol=1e-10, atol=1e-12):
                fail(f"Adasum step of {k}: {p.detach().numpy().ravel()[:3]} != {ref.ravel()[:3]}")

    @case("DistributedOptimizer(op=Adasum): trains, ranks stay equal")
    def _():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       backward_passes_per_step=2)
        g = torch.Generator().manual_seed(100 + r)
        w_true = torch.tensor([[1.0], [-2.0], [0.5]])
        x = torch.randn(64, 3, generator=g)
        y = x @ w_true
        losses = []
        for step in range(60):
            opt.zero_grad()
            for half in (x[:32], x[32:]):       # two local passes accumulate
                loss = torch.nn.functional.mse_loss(model(half), half @ w_true)
                loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
        if not losses[-1] < 0.5 * losses[0]:
            fail(f"Adasum training did not reduce the loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        everyone = hvd.allgather_object(hashlib.sha1(flat.tobytes()).hexdigest(), name="weights")
        if len(set(everyone)) != 1:
            fail(f"ranks ended with different weights: {everyone}")
        try:
            with opt.skip_synchronize():
                pass
            fail("skip_synchronize with Adasum: no error")
        except ValueError:
            pass
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                     gradient_predivide_factor=2.0)
            fail("gradient_predivide_factor with Adasum: no error")
        except ValueError:
            pass


def run_tf():
    import tensorflow as tf
    import hvd_magic.tensorflow as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    w = tf.Variable([1.0, 2.0, 3.0])
    b = tf.Variable(0.5, dtype=tf.float64)

    def wgrad(k):           # not parallel across ranks (parallel pairs: Adasum = average)
        return np.array([1.0, -1.0, 0.5]) + k * np.array([0.3, 1.0, -2.0])

    def grads_of(tape_fn):
        g0 = wgrad(r)
        gb = 0.25 * (r + 1.0)
        return g0, gb, tape_fn(tf.constant(g0, tf.float32), tf.constant(gb, tf.float64))

    def eager(g0, gb):
        with tf.GradientTape() as tape:
            loss = tf.cast(tf.reduce_sum(w * g0), tf.float64) + b * gb
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        return tape.gradient(loss, [w, b])

    graph = tf.function(eager)
    for label, fn in (("eager", eager), ("tf.function", graph)):
        @case(f"DistributedGradientTape(op=Adasum) {label}")
        def _():
            g0, gb, (gw, gbb) = grads_of(fn)
            ref_w = reference_adasum([wgrad(k) for k in range(n)])
            if np.allclose(ref_w, np.mean([wgrad(k) for k in range(n)], axis=0)):
                fail("test inputs: Adasum equals the average here")
            ref_b = reference_adasum([np.array(0.25 * (k + 1.0)) for k in range(n)])
            if not np.allclose(gw.numpy(), ref_w, rtol=1e-5):
                fail(f"{label}: w gradient {gw.numpy()} != {ref_w}")
            if not np.allclose(gbb.numpy(), ref_b, rtol=1e-12):
                fail(f"{label}: b gradient {gbb.numpy()} != {ref_b}")

    @case("sparse gradients with Adasum")
    def _():
        emb = tf.Variable(tf.ones([4, 2]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [1, 2]))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        try:
            tape.gradient(loss, [emb])
            fail("IndexedSlices with Adasum: no error")
        except ValueError as e:
            if "sparse_as_dense" not in str(e):
                fail(f"unclear message: {e}")
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [1, 2]))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, sparse_as_dense=True)
        (g,) = tape.gradient(loss, [emb])
        if not np.allclose(g.numpy(), [[0, 0], [1, 1], [1, 1], [0, 0]]):
            fail(f"sparse_as_dense Adasum of equal gradients: {g.numpy()}")

    @case("keras DistributedOptimizer(op=Adasum) refused")
    def _():
        import hvd_magic.keras as hk
        import keras
        try:
            hk.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum)
            fail("keras Adasum: no error")
        except ValueError as e:
            if "DistributedGradientTape" not in str(e):
                fail(f"unclear message: {e}")


def run_gloo(hvd, torch):
    """Through torch.distributed (the path of CUDA tensors): a clear error on every rank."""
    os.environ["HOROVOD_CPU_OPERATIONS"] = "gloo"
    hvd.init()
    try:
        @case("Adasum through torch.distributed")
        def _():
            if hvd.gloo_enabled():
                # the gloo controller (torchrun): CPU tensors take the same Adasum, over gloo
                got = hvd.allreduce(torch.ones(3), name="gloo adasum", op=hvd.Adasum)
                if not torch.allclose(got, torch.ones(3)):
                    fail(f"Adasum of equal vectors under the gloo controller: {got}")
                return
            try:
                hvd.allreduce(torch.ones(3), name="gloo adasum", op=hvd.Adasum)
                fail("Adasum through torch.distributed: no error")
            except hvd.HvdError as e:
                if "Adasum on GPU tensors is not supported" not in str(e):
                    fail(f"unclear message: {e}")
            if not torch.allclose(hvd.allreduce(torch.ones(3), name="gloo after"), torch.ones(3)):
                fail("allreduce after the Adasum error")
    finally:
        hvd.shutdown()
        os.environ.pop("HOROVOD_CPU_OPERATIONS")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    r = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    if mode == "tf":
        run_tf()
    else:
        import torch
        import hvd_magic.collectives as hvd
        torch.set_num_threads(1)
        hvd.init()
        try:
            run_collectives(hvd, torch)
            run_optimizer()
        finally:
            hvd.shutdown()
        run_gloo(hvd, torch)
    if FAILS:
        for f in FAILS:
            print(f"rank {r}: FAIL {f}", file=sys.stderr)
        print(f"rank {r}: {len(FAILS)} failures", file=sys.stderr)
        sys.exit(1)
    print(f"rank {r}: coll_adasum OK")


if __name__ == "__main__":
    main()
