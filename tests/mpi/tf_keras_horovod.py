"""hvd_magic.keras's Horovod entry points beyond model.fit, under real MPI (2 or 3 ranks):
DistributedOptimizer.compute_gradients / _compute_gradients + apply_gradients (reduced once),
register_local_var, gradient aggregation (LocalGradientAggregationHelper: counter, iterations,
sum or average), PartialDistributedOptimizer in model.fit, BroadcastGlobalVariablesCallback
with local_variables, from_config, the Keras-face collectives, and collectives in a TF1
session graph (run in build order on every rank).

Usage: mpiexec -n N python tf_keras_horovod.py
Exits nonzero with one line per failed check, prefixed by the rank."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvd_magic.keras as hk  # noqa: E402
import hvd_magic.tensorflow as hvd  # noqa: E402
from checklib import FAILS, check, close as _close, finish  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()


def close(label, a, b, atol=1e-5):
    _close(label, a, b, atol)


MEAN = (N + 1) / 2          # mean over ranks of (rank + 1)


@check("compute_gradients + apply_gradients reduce once")
def _():
    w = tf.Variable([0.0])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0))
    gv = opt.compute_gradients(lambda: w * (R + 1.0), [w])
    close("reduced gradient", gv[0][0], [MEAN])
    opt.apply_gradients(gv, experimental_aggregate_gradients=False)   # Keras 2 argument, ignored
    close("applied once", w.numpy(), [-MEAN])
    # a tensor loss with the tape that recorded it
    with tf.GradientTape() as tape:
        loss = w * (R + 1.0)
    close("tape loss", opt._compute_gradients(loss, [w], tape=tape)[0][0], [MEAN])
    opt.apply_gradients(zip([tf.constant([R + 1.0])], [w]))            # raw: reduced in apply
    close("raw gradients reduced in apply", w.numpy(), [-2 * MEAN])
    if not callable(opt.variables) or opt.variables() != opt.variables:
        FAILS.append("opt.variables() (Horovod's CallableList) does not answer")


@check("register_local_var keeps the gradient local, scaled by 1/size")
def _():
    shared, local = tf.Variable([0.0]), tf.Variable([0.0])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(local)
    (g_shared, _), (g_local, _) = opt.compute_gradients(
        lambda: (shared + local) * (R + 1.0), [shared, local])
    close("shared", g_shared, [MEAN])
    close("local", g_local, [(R + 1.0) / N])
    raw = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), scale_local_gradients=False)
    raw.register_local_var(local)
    close("local unscaled", raw.compute_gradients(lambda: local * (R + 1.0), [local])[0][0], [R + 1.0])


def aggregation(average, graph):
    k = 3
    w = tf.Variable([0.0])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=k,
                                  average_aggregated_gradients=average)

    def step():
        opt.apply_gradients(opt._compute_gradients(lambda: w * (R + 1.0), [w]))
    step = tf.function(step) if graph else step
    label = f"aggregation average={average} graph={graph}"
    per_update = MEAN * (1 if average else k)
    for i in range(1, 2 * k + 2):
        step()
        close(f"{label} pass {i} w", w.numpy(), [-per_update * (i // k)])
        if int(opt.iterations.numpy()) != i:
            FAILS.append(f"{label} pass {i}: iterations {int(opt.iterations.numpy())} != {i}")
        if int(opt._agg_helper.counter.numpy()) != i % k:
            FAILS.append(f"{label} pass {i}: counter {int(opt._agg_helper.counter.numpy())}")


@check("gradient aggregation, eager and tf.function")
def _():
    for average in (True, False):
        for graph in (False, True):
            aggregation(average, graph)


@check("aggregation keeps a local variable's gradient local")
def _():
    local = tf.Variable([0.0])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    opt.register_local_var(local)
    for _ in range(2):
        opt.apply_gradients(opt.compute_gradients(lambda: local * (R + 1.0), [local]))
    close("local after one update", local.numpy(), [-2 * (R + 1.0) / N])


def make_net(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])


def spread(arrays):
    flat = tf.constant(np.concatenate([np.ravel(a) for a in arrays]).astype(np.float64))
    return float(tf.reduce_max(hvd.allreduce(flat, op=hvd.Max) - hvd.allreduce(flat, op=hvd.Min)))


@check("PartialDistributedOptimizer: local layer differs, shared layers agree")
def _():
    model = make_net(7)
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=model.layers[0])
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(R)
    model.fit(rng.normal(size=(8, 3)), rng.normal(size=(8, 1)), batch_size=8, epochs=2, verbose=0)
    if spread(model.layers[1].get_weights()) != 0.0:
        FAILS.append("partial: shared layer differs across ranks")
    if N > 1 and spread(model.layers[0].get_weights()) == 0.0:
        FAILS.append("partial: local layer is the same on every rank")
    try:
        hk.PartialDistributedOptimizer(keras.optimizers.SGD(), op=hvd.Max)
        FAILS.append("partial op=Max not refused")
    except ValueError:
        pass


@check("BroadcastGlobalVariablesCallback(local_variables=...)")
def _():
    model = make_net(7)
    for v in model.variables:
        v.assign(tf.fill(v.shape, float(R)))
    model.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    root = N - 1
    local = list(model.layers[0].variables)
    cb = hk.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local)
    model.fit(np.ones((2, 3)), np.ones((2, 1)), verbose=0, callbacks=[cb])
    for v in local:
        close("local variable keeps its rank's value", v.numpy(), np.full(v.shape, float(R)))
    for v in model.layers[1].variables:
        close("other variable has the root's value", v.numpy(), np.full(v.shape, float(root)))
    try:
        hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1.0])
        FAILS.append("local_variables=[1.0] not refused")
    except ValueError:
        pass


@check("from_config: a DistributedOptimizer of the same settings")
def _():
    opt = hk.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2)
    copy = type(opt).from_config(opt.get_config())
    if not hk.is_distributed(copy) or copy.get_config() != opt.get_config() \
            or copy._agg_helper is None or copy._agg_helper.backward_passes_per_step != 2:
        FAILS.append("from_config lost the wrapper or its settings")


@check("Keras-face collectives: Horovod's Keras signatures, plain values in")
def _():
    close("allreduce name second", hk.allreduce([R + 1.0], "v"), [MEAN])
    close("allreduce average=False", hk.allreduce(R + 1.0, "s", False), N * MEAN)
    close("allgather", hk.allgather([float(R)], "g"), [float(r) for r in range(N)])
    close("broadcast int", hk.broadcast(R + 7, N - 1, "b"), N + 6)
    close("reducescatter", hk.reducescatter([[R + 1.0]] * N, "rs"), [[MEAN]])


@check("TF1 session graph: unnamed collectives fetched together run in build order")
def _():
    graph = tf.Graph()
    with graph.as_default():
        dtypes = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64]
        outs = [hvd.allreduce(tf.ones([2 + i], dtype=d), op=hvd.Sum) for i, d in enumerate(dtypes)]
        outs.append(hvd.allgather(tf.fill([1], float(R))))
        outs.append(hvd.broadcast(tf.fill([3], float(R)), 0))
        with tf.compat.v1.Session(graph=graph) as sess:
            for _ in range(3):             # TF's executor picks a different order each run
                got = sess.run(outs)
    for i, d in enumerate(dtypes):
        close(f"graph allreduce {d.name}", got[i], np.full(2 + i, N))
    close("graph allgather", got[-2], np.arange(N))
    close("graph broadcast", got[-1], np.zeros(3))


finish(hvd)
