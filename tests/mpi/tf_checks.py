"""hvd_magic.tensorflow / hvd_magic.keras under real MPI (2 or 3 ranks), grouped in one
launch because importing TensorFlow costs seconds: collectives eager and in tf.function,
their gradients, DistributedGradientTape against single-process gradients of the whole
batch, model.fit with DistributedOptimizer against single-process training, callbacks,
mismatch errors, checkpoint + load_model, and process sets (even and odd ranks running every
collective and its gradient at once, the set ops, a rank off a set refused).

Usage: mpiexec -n N python tf_checks.py WORKDIR
Exits nonzero with one line per failed check, prefixed by the rank."""
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvd_magic.keras as hk  # noqa: E402
import hvd_magic.tensorflow as hvd  # noqa: E402

hvd.init(process_sets="dynamic")     # the process-set checks add and remove sets
R, N = hvd.rank(), hvd.size()
WORK = sys.argv[1]
FAILS = []
TIMES = os.environ.get("TF_CHECKS_TIMES") == "1"


def check(label):
    def deco(fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            FAILS.append(f"{label}: raised\n{traceback.format_exc()}")
        if TIMES and R == 0:
            print(f"{label}: {time.perf_counter() - t0:.2f} s", flush=True)
        return fn
    return deco


def close(label, a, b, atol=1e-5):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        FAILS.append(f"{label}: shape {a.shape} != {b.shape}")
    elif not np.allclose(a, b, atol=atol, rtol=0):
        FAILS.append(f"{label}: max diff {np.abs(a - b).max():.3g} > {atol}\n{a}\n{b}")


def same_everywhere(label, arrays):
    """Every rank holds bitwise the same arrays."""
    flat = np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])
    spread = hvd.allreduce(tf.constant(flat), op=hvd.Max) - hvd.allreduce(tf.constant(flat), op=hvd.Min)
    if float(tf.reduce_max(spread)) != 0.0:
        FAILS.append(f"{label}: differs across ranks by {float(tf.reduce_max(spread)):.3g}")


# ---------------------------------------------------------------- collectives, eager and graph
def collectives(run):
    x = tf.constant([1.0 + R, 2.0])
    close("allreduce avg", run(lambda: hvd.allreduce(x)), [1 + (N - 1) / 2, 2.0])
    close("allreduce sum", run(lambda: hvd.allreduce(x, op=hvd.Sum)), [N + N * (N - 1) / 2, 2.0 * N])
    close("allreduce max", run(lambda: hvd.allreduce(x, op=hvd.Max)), [N, 2.0])
    close("allreduce scale", run(lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                                       postscale_factor=0.5)),
          [N + N * (N - 1) / 2, 2.0 * N])
    for c in (hvd.Compression.fp16, hvd.Compression.bf16):
        out = run(lambda: hvd.allreduce(x, compression=c))
        if out.dtype != tf.float32:
            FAILS.append(f"allreduce {c.__name__}: dtype {out.dtype}")
        close(f"allreduce {c.__name__}", out, [1 + (N - 1) / 2, 2.0], atol=2e-2)
    close("allreduce bf16 tensor", tf.cast(run(lambda: hvd.allreduce(tf.cast(x, tf.bfloat16))),
                                           tf.float32), [1 + (N - 1) / 2, 2.0], atol=2e-2)
    g = run(lambda: hvd.grouped_allreduce([x, tf.constant([R], tf.int32), tf.ones([2, 2])], op=hvd.Sum))
    close("grouped 0", g[0], [N + N * (N - 1) / 2, 2.0 * N])
    close("grouped 1", g[1], [N * (N - 1) / 2])
    close("grouped 2", g[2], np.full((2, 2), N))
    ag = run(lambda: hvd.allgather(tf.fill([R + 1, 2], R)))
    close("allgather uneven", ag, np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    close("allgather scalar", run(lambda: hvd.allgather(tf.constant(float(R)))), np.arange(N))
    close("broadcast", run(lambda: hvd.broadcast(x, N - 1)), [float(N), 2.0])
    out = run(lambda: hvd.alltoall(tf.constant([10 * R + j for j in range(N)])))
    close("alltoall", out, [10 * j + R for j in range(N)])     # no splits given: output alone
    out, rs = run(lambda: hvd.alltoall(tf.constant([10 * R + j for j in range(N)]), splits=[1] * N))
    close("alltoall with splits", out, [10 * j + R for j in range(N)])
    close("alltoall received splits", rs, [1] * N)
    splits = [1 if j == 0 else 0 for j in range(N)]   # everybody sends its one row to rank 0
    out, rs = run(lambda: hvd.alltoall(tf.constant([[float(R)]]), splits=splits))
    close("alltoall uneven", out, [[float(j)] for j in range(N)] if R == 0 else np.zeros((0, 1)))
    close("alltoall uneven splits", rs, [1] * N if R == 0 else [0] * N)
    rows = 2 * N + 1
    base = tf.reshape(tf.range(rows * 2, dtype=tf.float32), [rows, 2])
    rs_out = run(lambda: hvd.reducescatter(base, op=hvd.Sum))
    mine = 3 if R == 0 else 2
    start = 0 if R == 0 else 3 + 2 * (R - 1)
    close("reducescatter", rs_out, N * base.numpy()[start:start + mine])
    ga = run(lambda: hvd.grouped_allgather([tf.fill([R + 1, 2], R), tf.constant(float(R)),
                                            tf.constant([R], tf.int64)]))
    close("grouped_allgather uneven", ga[0], np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    close("grouped_allgather scalar", ga[1], np.arange(N))
    close("grouped_allgather int64", ga[2], np.arange(N))
    if ga[2].dtype != tf.int64:
        FAILS.append(f"grouped_allgather int64: dtype {ga[2].dtype}")
    grs = run(lambda: hvd.grouped_reducescatter([base, tf.cast(base, tf.int32)], op=hvd.Sum))
    close("grouped_reducescatter", grs[0], N * base.numpy()[start:start + mine])
    close("grouped_reducescatter int32", grs[1], N * base.numpy()[start:start + mine])
    grs = run(lambda: hvd.grouped_reducescatter([base * (R + 1.0)], postscale_factor=2.0))
    close("grouped_reducescatter average", grs[0], (N + 1) * base.numpy()[start:start + mine])


@check("collectives eager")
def _():
    collectives(lambda f: f())


@check("collectives tf.function")
def _():
    def run(f):
        return tf.function(f)()
    collectives(run)

    traced = []

    @tf.function
    def shapes(x):
        outs = [hvd.allreduce(x), hvd.allgather(x), hvd.broadcast(x, 0), hvd.reducescatter(x)]
        traced.extend(tuple(t.shape.as_list()) for t in outs)
        return outs
    shapes(tf.zeros([3 * N, 4]))
    if traced != [(3 * N, 4), (None, 4), (3 * N, 4), (3, 4)]:
        FAILS.append(f"static shapes in tf.function: {traced}")


@check("collective gradients")
def _():
    w = tf.Variable([1.0, 2.0])

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            a = tf.reduce_sum(hvd.allreduce(w * (R + 1.0), op=hvd.Sum))
            b = tf.reduce_sum(hvd.allgather(w * (R + 1.0)))
            c = tf.reduce_sum(hvd.broadcast(w * (R + 1.0), 0))
            d = tf.reduce_sum(hvd.reducescatter(tf.stack([w] * N), op=hvd.Sum))
            e = tf.reduce_sum(hvd.alltoall(tf.stack([w] * N)) * (R + 1.0))
        return [tape.gradient(t, w) for t in (a, b, c, d, e)]
    tri = N * (N + 1) / 2
    for run in (grads, tf.function(grads)):
        a, b, c, d, e = run()
        close("grad allreduce", a, [N * (R + 1.0)] * 2)   # dy summed over ranks, times own factor
        close("grad allgather", b, [R + 1.0] * 2)         # dy averaged over ranks, as Horovod
        close("grad broadcast", c, [1.0 if R == 0 else 0.0] * 2)
        close("grad reducescatter", d, [N * N] * 2)      # Horovod: Sum's gradient times size
        close("grad alltoall", e, [tri] * 2)


@check("grouped collective gradients")
def _():
    w = tf.Variable([1.0, 2.0])

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            ys = hvd.grouped_allgather([w * (R + 1.0), tf.cast(w, tf.float64) * R])
            a = tf.reduce_sum(ys[0]) + tf.cast(tf.reduce_sum(ys[1]), tf.float32)
            b = tf.reduce_sum(hvd.grouped_reducescatter([tf.stack([w] * N)], op=hvd.Sum)[0])
            c = tf.reduce_sum(hvd.grouped_reducescatter([tf.stack([w] * N), tf.stack([w] * (N + 1))],
                                                        prescale_factor=2.0)[1])
        return [tape.gradient(t, w) for t in (a, b, c)]
    for run in (grads, tf.function(grads)):
        a, b, c = run()
        close("grad grouped_allgather", a, [2.0 * R + 1.0] * 2)   # averaged over ranks
        close("grad grouped_reducescatter sum", b, [N * N] * 2)   # Horovod: times size for Sum
        close("grad grouped_reducescatter average", c, [2.0 * (N + 1)] * 2)


# ---------------------------------------------------------------- gradient tape
B = 4
rng = np.random.default_rng(1)
XG = rng.normal(size=(B * N, 5)).astype("float32")
YG = rng.normal(size=(B * N, 1)).astype("float32")
IDX = rng.integers(0, 10, size=(B * N,))


def make_net(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


@check("DistributedGradientTape == single-process whole batch")
def _():
    net = make_net(7)
    emb = tf.Variable(tf.random.stateless_normal([10, 1], seed=[1, 2]))
    variables = net.trainable_variables + [emb]

    def loss_of(x, y, idx):
        pred = net(x) + tf.gather(emb, idx)
        return tf.reduce_mean((pred - y) ** 2)

    with tf.GradientTape() as tape:
        ref_loss = loss_of(XG, YG, IDX)
    ref = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(ref_loss, variables)]
    mine = slice(R * B, (R + 1) * B)

    def dist(**kw):
        with tf.GradientTape() as tape:
            loss = loss_of(XG[mine], YG[mine], IDX[mine])
        return hvd.DistributedGradientTape(tape, **kw).gradient(loss, variables)

    for label, graph, kw, atol in [("eager", False, {}, 1e-5),
                                   ("tf.function", True, {}, 1e-5),
                                   ("sparse_as_dense", False, {"sparse_as_dense": True}, 1e-5),
                                   ("num_groups=2", True, {"num_groups": 2}, 1e-5),
                                   ("predivide", False, {"gradient_predivide_factor": 2.0}, 1e-5),
                                   ("fp16", False, {"compression": hvd.Compression.fp16}, 3e-3)]:
        got = tf.function(lambda kw=kw: dist(**kw))() if graph else dist(**kw)
        if label == "sparse_as_dense" and isinstance(got[-1], tf.IndexedSlices):
            FAILS.append("sparse_as_dense left tf.IndexedSlices")
        if label == "eager" and not isinstance(got[-1], tf.IndexedSlices):
            FAILS.append(f"embedding gradient should stay tf.IndexedSlices, got {type(got[-1])}")
        for i, (g, r) in enumerate(zip(got, ref)):
            close(f"tape {label} grad {i}", tf.convert_to_tensor(g), r, atol)
    summed = dist(op=hvd.Sum)
    close("tape op=Sum", summed[0], N * ref[0], 1e-5)


# ---------------------------------------------------------------- keras fit
STEPS = 6
XK = rng.normal(size=(STEPS * B * N, 5)).astype("float32")
YK = rng.normal(size=(STEPS * B * N, 1)).astype("float32")
SHARD = np.concatenate([np.arange(k * B * N + R * B, k * B * N + (R + 1) * B) for k in range(STEPS)])


def fit_pair(label, make_opt, epochs=2, bpps=1, average_aggregated=False):
    model = make_net(100 + R)    # every rank starts elsewhere; the callback fixes that
    opt = hk.DistributedOptimizer(make_opt(), backward_passes_per_step=bpps,
                                  average_aggregated_gradients=average_aggregated)
    model.compile(optimizer=opt, loss="mse")
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = make_net(100)
    ref.compile(optimizer=make_opt(), loss="mse")
    ref_scale = 1.0 if average_aggregated or bpps == 1 else float(bpps)
    if ref_scale != 1.0:
        ref.optimizer.learning_rate = float(ref.optimizer.learning_rate) * ref_scale
    ref.fit(XK, YK, batch_size=B * N * bpps, epochs=epochs, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights())):
        close(f"fit {label} weight {i}", a, b, 2e-5)
    same_everywhere(f"fit {label} weights", model.get_weights())
    want_iters = epochs * STEPS        # as Horovod's: every pass counts, applied or not
    if int(opt.iterations.numpy()) != want_iters:
        FAILS.append(f"fit {label}: iterations {int(opt.iterations.numpy())} != {want_iters}")
    return model


@check("model.fit SGD == single-process whole batch")
def _():
    fit_pair("sgd", lambda: keras.optimizers.SGD(0.1))
    fit_pair("sgd momentum", lambda: keras.optimizers.SGD(0.05, momentum=0.9))


@check("model.fit backward_passes_per_step=2")
def _():
    fit_pair("bpps avg", lambda: keras.optimizers.SGD(0.1), bpps=2, average_aggregated=True)
    fit_pair("bpps sum", lambda: keras.optimizers.SGD(0.05), bpps=2)


@check("model.fit Adam, identical on all ranks")
def _():
    model = make_net(100 + R)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_everywhere("adam weights", model.get_weights())
    same_everywhere("adam slots", [v.numpy() for v in model.optimizer.variables])


# ---------------------------------------------------------------- callbacks
class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_lr, self.epoch_lr, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lr.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_lr.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


@check("MetricAverageCallback")
def _():
    logs = {"loss": float(R), "accuracy": 2.0 * R, "name": "x"}
    hk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    close("metric average", [logs["loss"], logs["accuracy"]], [(N - 1) / 2, N - 1.0])
    model = make_net(100)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse",
                  metrics=["mae"])
    plain, averaged = Recorder(), Recorder()
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[plain, hk.callbacks.MetricAverageCallback(), averaged])
    local = np.array([plain.logs[0]["loss"], plain.logs[0]["mae"]])
    mean = hvd.allreduce(tf.constant(local)).numpy()
    close("fit metric average", [averaged.logs[0]["loss"], averaged.logs[0]["mae"]], mean, 1e-6)


@check("learning-rate warmup and schedule")
def _():
    steps, lr0, warm = STEPS, 0.1 * N, 2
    model = make_net(100)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse")
    rec = Recorder()
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=warm), rec])
    want = [lr0 / N * ((e + b / steps) * (N - 1) / warm + 1) for e in range(warm) for b in range(steps)]
    close("warmup per batch", rec.batch_lr[:warm * steps], want, 1e-6)
    close("after warmup", rec.batch_lr[warm * steps:], [lr0] * steps, 1e-6)
    model = make_net(100)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse")
    rec = Recorder()
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=4, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.LearningRateScheduleCallback(lr0, multiplier=lambda e: 0.5 ** e,
                                                                   start_epoch=1, end_epoch=3),
                         rec])
    close("schedule per epoch", rec.epoch_lr, [lr0, lr0 * 0.5, lr0 * 0.25, lr0 * 0.25], 1e-6)


# ---------------------------------------------------------------- errors
@check("mismatch raises TensorMismatchError on every rank")
def _():
    try:
        hvd.allreduce(tf.zeros([R + 2]), name="mismatch.eager")
        FAILS.append("eager shape mismatch did not raise")
    except hvd.TensorMismatchError as exc:
        if "mismatch.eager" not in str(exc):
            FAILS.append(f"eager mismatch message lacks the tensor name: {exc}")
    try:
        tf.function(lambda: hvd.allreduce(tf.zeros([R + 2]), name="mismatch.graph"))()
        FAILS.append("graph shape mismatch did not raise")
    except tf.errors.FailedPreconditionError as exc:   # Horovod's class, also in a graph
        if "TensorMismatchError" not in str(exc) or "mismatch.graph" not in str(exc):
            FAILS.append(f"graph mismatch message: {exc}")
    close("usable after mismatch", hvd.allreduce(tf.ones([2])), [1.0, 1.0])
    try:
        hvd.grouped_allgather([tf.zeros([1, 2]), tf.zeros([1, R + 2])], name="mismatch.grouped")
        FAILS.append("grouped_allgather shape mismatch did not raise")
    except hvd.TensorMismatchError as exc:
        if "'mismatch.grouped.1'" not in str(exc):
            FAILS.append(f"grouped mismatch message lacks the member's name: {exc}")
    try:
        tf.function(lambda: hvd.grouped_reducescatter([tf.zeros([N + R])], name="mismatch.grs"))()
        FAILS.append("graph grouped_reducescatter shape mismatch did not raise")
    except tf.errors.FailedPreconditionError as exc:
        if "TensorMismatchError" not in str(exc) or "mismatch.grs" not in str(exc):
            FAILS.append(f"graph grouped mismatch message: {exc}")
    close("usable after grouped mismatch", hvd.allreduce(tf.ones([2])), [1.0, 1.0])
    for bad, exc_type in [(lambda: hvd.allreduce("x"), TypeError),
                          (lambda: hk.DistributedOptimizer(object()), TypeError),
                          (lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Max), ValueError),
                          (lambda: hk.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
                           ValueError)]:
        try:
            bad()
            FAILS.append(f"no {exc_type.__name__} from a bad call")
        except exc_type:
            pass


# ---------------------------------------------------------------- broadcast_, rank ops
@check("broadcast_ eager and tf.function, broadcast_object_fn")
def _():
    v = tf.Variable(tf.fill([3], float(R)))
    i = tf.Variable([R, R], dtype=tf.int64)
    out = hvd.broadcast_([v, i], root_rank=N - 1, name="bcast_.eager")
    close("broadcast_ assigns", np.concatenate([v.numpy(), i.numpy()]), [N - 1.0] * 5)
    close("broadcast_ returns", np.concatenate([out[0].numpy(), out[1].numpy()]), [N - 1.0] * 5)
    v.assign(tf.fill([3], float(R)))
    got = tf.function(lambda: hvd.broadcast_([v], root_rank=0))()
    close("broadcast_ graph assigns", v.numpy(), [0.0] * 3)
    close("broadcast_ graph returns", got[0], [0.0] * 3)
    if hvd.broadcast_object_fn(root_rank=N - 1)({"r": R}) != {"r": N - 1}:
        FAILS.append("broadcast_object_fn")


@check("rank and size ops")
def _():
    want = [N, hvd.local_size(), R, hvd.local_rank(), 1]
    names = ["size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op"]
    for label, run in (("eager", lambda f: f()), ("tf.function", lambda f: tf.function(f)())):
        got = [run(getattr(hvd, n)) for n in names]
        if [int(g) for g in got] != want or any(g.dtype != tf.int32 for g in got):
            FAILS.append(f"rank/size ops {label}: {got} != {want}")


# ---------------------------------------------------------------- process sets
EVENS, ODDS = [k for k in range(N) if k % 2 == 0], [k for k in range(N) if k % 2 == 1]


def raises(label, fn, kind, *fragments):
    try:
        fn()
    except kind as exc:
        for f in fragments:
            if f not in str(exc):
                FAILS.append(f"{label}: message lacks {f!r}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        FAILS.append(f"{label}: expected {kind.__name__}, got {type(exc).__name__}: {exc}")
        return
    FAILS.append(f"{label}: no {kind.__name__}")


def set_collectives(label, run, ps, mates):
    """Values of every collective in ``ps`` (ranks ``mates``), against references."""
    m, i = len(mates), mates.index(R)
    x = tf.constant([1.0 + R, 2.0])
    close(f"{label} allreduce sum", run(lambda: hvd.allreduce(x, op=hvd.Sum, process_set=ps)),
          [sum(1.0 + k for k in mates), 2.0 * m])
    close(f"{label} allreduce avg", run(lambda: hvd.allreduce(x, process_set=ps)),
          [np.mean([1.0 + k for k in mates]), 2.0])
    g = run(lambda: hvd.grouped_allreduce([x, tf.constant([R], tf.int32)], op=hvd.Sum, process_set=ps))
    close(f"{label} grouped_allreduce 0", g[0], [sum(1.0 + k for k in mates), 2.0 * m])
    close(f"{label} grouped_allreduce 1", g[1], [sum(mates)])
    close(f"{label} allgather", run(lambda: hvd.allgather(tf.fill([R + 1, 2], R), process_set=ps)),
          np.concatenate([np.full((k + 1, 2), k) for k in mates]))
    ga = run(lambda: hvd.grouped_allgather([tf.constant([R]), tf.constant(float(R))], process_set=ps))
    close(f"{label} grouped_allgather", np.concatenate([ga[0], ga[1]]), mates + mates)
    root = mates[-1]            # a global rank, the set's last
    close(f"{label} broadcast", run(lambda: hvd.broadcast(x, root, process_set=ps)), [1.0 + root, 2.0])
    rows = 2 * m + 1
    base = tf.reshape(tf.range(rows * 2, dtype=tf.float32), [rows, 2])
    share = [rows // m + (1 if j < rows % m else 0) for j in range(m)]
    start = sum(share[:i])
    want = m * base.numpy()[start:start + share[i]]
    close(f"{label} reducescatter", run(lambda: hvd.reducescatter(base, op=hvd.Sum, process_set=ps)), want)
    grs = run(lambda: hvd.grouped_reducescatter([base], op=hvd.Sum, process_set=ps))
    close(f"{label} grouped_reducescatter", grs[0], want)
    close(f"{label} alltoall", run(lambda: hvd.alltoall(tf.constant([10 * R + j for j in range(m)]),
                                                       process_set=ps)), [10 * k + i for k in mates])
    out, rs = run(lambda: hvd.alltoall(tf.fill([m, 1], R), splits=[1] * m, process_set=ps))
    close(f"{label} alltoall splits", np.concatenate([np.ravel(out), rs]), mates + [1] * m)


def set_gradients(label, run, ps, mates):
    """Gradients of the collectives in ``ps``: each backward pass runs in the set."""
    m, i = len(mates), mates.index(R)
    w = tf.Variable([1.0, 2.0])
    sq = np.mean([(k + 1.0) ** 2 for k in mates])      # differs from the global mean
    total = sum(k + 1 for k in mates)
    c = np.arange(1.0, total + 1.0, dtype=np.float32).reshape(-1, 1)
    start = sum(k + 1 for k in mates[:i])
    f = float(R + 1)

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            y = [tf.reduce_sum(hvd.allreduce(w * f, op=hvd.Sum, process_set=ps)),
                 tf.reduce_sum(hvd.allgather(tf.stack([w] * (R + 1)) * f, process_set=ps) * c) * f * f,
                 tf.reduce_sum(hvd.broadcast(w * f, mates[-1], process_set=ps)) * f * f,
                 tf.reduce_sum(hvd.reducescatter(tf.stack([w] * m), op=hvd.Sum, process_set=ps)),
                 tf.reduce_sum(hvd.alltoall(tf.stack([w] * m), process_set=ps) * f),
                 tf.reduce_sum(hvd.grouped_allreduce([w * f], op=hvd.Sum, process_set=ps)[0]),
                 tf.reduce_sum(hvd.grouped_allgather([w * f], process_set=ps)[0]) * f * f]
        return [tape.gradient(t, w) for t in y]
    got = run(grads)
    want = [m * f, f * float(c[start:start + R + 1].sum()) * sq, f * sq if R == mates[-1] else 0.0,
            m * m, total, m * f, f * sq]   # reducescatter (Sum): times the set's size, as Horovod
    names = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "grouped_allreduce",
             "grouped_allgather"]
    for what, g, v in zip(names, got, want):
        close(f"{label} grad {what}", g, [v] * 2)


@check("process sets: even and odd ranks at once, eager and tf.function")
def _():
    ev, od = hvd.add_process_set(EVENS), hk.add_process_set(hk.ProcessSet(ODDS))   # keras exports too
    try:
        mine, other = (ev, od) if R % 2 == 0 else (od, ev)
        mates = EVENS if R % 2 == 0 else ODDS
        m, i = len(mates), mates.index(R)
        for label, run in (("eager", lambda fn: fn()), ("tf.function", lambda fn: tf.function(fn)())):
            set_collectives(f"set {label}", run, mine, mates)
            set_gradients(f"set {label}", run, mine, mates)
            got = [int(run(lambda: hvd.size_op(ps.process_set_id))) for ps in (mine, other)]
            got += [int(run(lambda: hvd.process_set_included_op(ps.process_set_id))) for ps in (mine, other)]
            if got != [m, N - m, 1, 0]:
                FAILS.append(f"size_op/process_set_included_op {label}: {got} != {[m, N - m, 1, 0]}")
        traced = []

        @tf.function
        def shapes(x):
            outs = [hvd.reducescatter(x, process_set=mine),
                    hvd.alltoall(x, splits=[2 * m + 1 if j == 0 else 0 for j in range(m)],
                                 process_set=mine)[1]]
            traced.extend(tuple(t.shape.as_list()) for t in outs)
            return outs
        shapes(tf.zeros([2 * m + 1, 4]))
        rows = (2 * m + 1) // m + (1 if i < (2 * m + 1) % m else 0)
        if traced != [(rows, 4), (m,)]:
            FAILS.append(f"static shapes in a set: {traced}")
        v = tf.Variable(tf.fill([3], float(R)))
        hvd.broadcast_variables([v], root_rank=mates[0], process_set=mine)
        out = hvd.broadcast_([tf.Variable([R, R], dtype=tf.int64)], mates[-1], process_set=mine)
        close("set broadcast_variables, broadcast_", np.concatenate([v.numpy(), out[0].numpy()]),
              [mates[0]] * 3 + [mates[-1]] * 2)
        if (hvd.broadcast_object({"r": R}, mates[-1], process_set=mine) != {"r": mates[-1]}
                or hvd.allgather_object(R, process_set=mine) != mates):
            FAILS.append("broadcast_object / allgather_object in a set")
        hvd.barrier(process_set=mine)
        # DistributedGradientTape / keras DistributedOptimizer over the set: its ranks' mean
        w = tf.Variable([1.0, 1.0])
        loc = tf.Variable([1.0])
        with hvd.DistributedGradientTape(tf.GradientTape(), process_set=mine) as tape:
            loss = tf.reduce_sum(w * float(R)) + tf.reduce_sum(loc * float(R))
        tape.register_local_source(loc)
        gw, gl = tape.gradient(loss, [w, loc])
        close("set tape", gw, [float(np.mean(mates))] * 2)
        close("set tape, local source scaled by the set's size", gl, [R / m])
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=mine)
        kv = keras.Variable([0.0])
        opt.apply_gradients([(tf.constant([float(R)]), kv)])
        close("set keras optimizer", kv.numpy(), [-float(np.mean(mates))])
        with hvd.DistributedGradientTape(tf.GradientTape(), process_set=other) as tape:
            loss = tf.reduce_sum(w * float(R))
        close("tape outside the set: local gradients", tape.gradient(loss, w), [float(R)] * 2)
        # a set this rank is not in: ValueError here, naming the set, eagerly and when traced
        want = f"not in process set {other.process_set_id}"
        x = tf.ones([2])
        raises("allreduce off the set", lambda: hvd.allreduce(x, process_set=other), ValueError, want)
        def gather_off():
            return hvd.allgather(x, process_set=other)
        raises("traced allgather off the set", lambda: tf.function(gather_off)(), ValueError, want)
        for fn in (lambda: hvd.broadcast(x, R, process_set=other),
                   lambda: hvd.grouped_allreduce([x], process_set=other),
                   lambda: hvd.alltoall(x, process_set=other),
                   lambda: hvd.reducescatter(x, process_set=other),
                   lambda: hvd.broadcast_variables([tf.Variable(x)], R, process_set=other)):
            raises("collective off the set", fn, ValueError, want)
        if N > m:
            outsider = [k for k in range(N) if k not in mates][0]
            raises("root off the set", lambda: hvd.broadcast(x, outsider, process_set=mine), ValueError,
                   f"root_rank={outsider} is not in process set {mine.process_set_id}")
        raises("size_op of no set", lambda: hvd.size_op(99), ValueError, "process_set_id=99")
        raises("process_set_included_op of no set", lambda: hvd.process_set_included_op(99), ValueError,
               "process_set_id=99")
    finally:
        hvd.remove_process_set(od)
        hvd.remove_process_set(ev)
    raises("size_op of a removed set", lambda: hvd.size_op(ev.process_set_id or 1), ValueError,
           "no process set with that id")
    close("global set after the sets", hvd.allreduce(tf.ones([2]), op=hvd.Sum), [N, N])


# ---------------------------------------------------------------- broadcast_variables, checkpoints
@check("broadcast_variables eager and tf.function, objects")
def _():
    v = tf.Variable(tf.fill([3], float(R)))
    i = tf.Variable([R, R], dtype=tf.int64)
    hvd.broadcast_variables([v, i], root_rank=N - 1)
    close("broadcast_variables", np.concatenate([v.numpy(), i.numpy()]), [N - 1.0] * 5)
    v.assign(tf.fill([3], float(R)))
    @tf.function
    def bcast():
        hvd.broadcast_variables([v], root_rank=0)
    bcast()
    close("broadcast_variables graph", v.numpy(), [0.0] * 3)
    if hvd.broadcast_object({"r": R}, root_rank=1) != {"r": 1}:
        FAILS.append("broadcast_object")
    if hvd.allgather_object(R) != list(range(N)):
        FAILS.append("allgather_object")


@check("BestModelCheckpoint on rank 0 and load_model")
def _():
    path = os.path.join(WORK, "best.keras")
    marker = os.path.join(WORK, f"rank{R}.keras")
    model = make_net(100)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=2, shuffle=False, verbose=0,
              validation_data=(XK[:8], YK[:8]),
              callbacks=[hk.callbacks.MetricAverageCallback(),
                         hk.callbacks.BestModelCheckpoint(path if R == 0 else marker, monitor="val_loss")])
    hvd.barrier()
    if R != 0 and os.path.exists(marker):
        FAILS.append("BestModelCheckpoint wrote on a rank other than 0")
    if not os.path.exists(path):
        FAILS.append("BestModelCheckpoint wrote nothing on rank 0")
        return
    loaded = hk.load_model(path)
    if not hk.is_distributed(loaded.optimizer) or not isinstance(loaded.optimizer, keras.optimizers.SGD):
        FAILS.append(f"load_model optimizer not re-wrapped: {type(loaded.optimizer)}")
    if int(loaded.optimizer.iterations.numpy()) == 0:
        FAILS.append("load_model lost the optimizer state")
    loaded.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=1, shuffle=False, verbose=0)
    same_everywhere("trained after load_model", loaded.get_weights())


# ---------------------------------------------------------------- SyncBatchNormalization
SB = [3 + r for r in range(N)]                    # rows per rank: a different size on each
SB_MINE = slice(sum(SB[:R]), sum(SB[:R + 1]))
rng_sb = np.random.default_rng(5)
XS = (rng_sb.normal(size=(sum(SB), 2, 3)) * [1.0, 2.0, 0.5] + [0.0, 3.0, -1.0]).astype("float32")
GS = rng_sb.normal(size=XS.shape).astype("float32")          # loss = sum(y * GS)
MS = rng_sb.random(size=XS.shape[:2]) > 0.3                   # mask: input shape less the channels
SB_WEIGHTS = [np.array([0.5, -1.5, 2.0], "float32"), np.array([0.1, 0.2, -0.3], "float32"),
              np.array([0.3, 1.0, -0.5], "float32"), np.array([2.0, 0.5, 1.5], "float32")]


def bn_step(layer, x, g, mask):
    """Output and the gradients of sum(y * g) w.r.t. x, gamma and beta, in training."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True, mask=mask) * g)
    y = layer(x, training=False)     # not training: the moving statistics, no collective
    return [loss, y] + tape.gradient(loss, [x, layer.gamma, layer.beta])


@check("SyncBatchNormalization == BatchNormalization on all ranks' batches")
def _():
    for graph in (False, True):
        for masked in (False, True):
            label = f"sync bn {'tf.function' if graph else 'eager'}{' masked' if masked else ''}"
            sync = hvd.SyncBatchNormalization(momentum=0.9)
            ref = keras.layers.BatchNormalization(momentum=0.9)
            for layer in (sync, ref):
                layer.build((None,) + XS.shape[1:])
                layer.set_weights(SB_WEIGHTS)
            mask = tf.constant(MS[SB_MINE]) if masked else None
            def step():
                return bn_step(sync, XS[SB_MINE], GS[SB_MINE], mask)
            step = tf.function(step) if graph else step
            for _ in range(2):            # twice: the moving statistics move twice
                got = step()
                want = bn_step(ref, XS, GS, tf.constant(MS) if masked else None)
            close(f"{label} loss summed", hvd.allreduce(got[0], op=hvd.Sum), want[0], 1e-4)
            close(f"{label} moving_mean", sync.moving_mean.numpy(), ref.moving_mean.numpy())
            close(f"{label} moving_variance", sync.moving_variance.numpy(), ref.moving_variance.numpy())
            close(f"{label} inference output", got[1], want[1][SB_MINE])
            close(f"{label} grad x", got[2], want[2][SB_MINE])
            close(f"{label} grad gamma summed", hvd.allreduce(got[3], op=hvd.Sum), want[3], 1e-4)
            close(f"{label} grad beta summed", hvd.allreduce(got[4], op=hvd.Sum), want[4], 1e-4)
            y = sync(tf.constant(XS[SB_MINE]), training=True)
            close(f"{label} training output", y, ref(XS, training=True)[SB_MINE])


def make_bn_net(seed, bn):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), bn(momentum=0.5),
                             keras.layers.Activation("tanh"), keras.layers.Dense(1)])


@check("model.fit with SyncBatchNormalization == single-process BatchNormalization")
def _():
    model = make_bn_net(100 + R, hvd.SyncBatchNormalization)
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(XK[SHARD], YK[SHARD], batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = make_bn_net(100, keras.layers.BatchNormalization)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(XK, YK, batch_size=B * N, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights())):
        close(f"fit sync bn weight {i}", a, b, 1e-4)
    same_everywhere("fit sync bn weights", model.get_weights())
    close("predict sync bn", model.predict(XK[:8], verbose=0), ref.predict(XK[:8], verbose=0), 1e-4)


hvd.barrier()
if FAILS:
    for f in FAILS:
        print(f"[rank {R}] FAIL {f}", flush=True)
print(f"[rank {R}] done, {len(FAILS)} failures", flush=True)
hvd.shutdown()
sys.exit(1 if FAILS else 0)
