"""hvd_magic.keras and hvd_magic.tensorflow with Keras 2 (tf_keras as tf.keras, chosen by
TF_USE_LEGACY_KERAS=1), under real MPI (2 or 3 ranks): model.fit with DistributedOptimizer
and the callbacks gives every rank the same weights, equal to single-process SGD on the
ranks' batches put together; tf_keras's legacy optimizers; gradient aggregation;
DistributedGradientTape with ``opt.variables()`` broadcast (Horovod's tensorflow2 example).

Usage: mpiexec -n N python tf_legacy_keras.py
Exits nonzero with one line per failed check, prefixed by the rank."""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"      # before TensorFlow is imported, as a user does
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hvd_magic.keras as hk  # noqa: E402
import hvd_magic.tensorflow as hvd  # noqa: E402
import hvd_magic.tensorflow.keras as htk  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
BATCH, STEPS = 4, 3


def data(rank):
    rng = np.random.RandomState(100 + rank)
    x = rng.normal(size=(BATCH * STEPS, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)


def model(seed):
    tf.keras.utils.set_random_seed(seed)
    m = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh", input_shape=(3,)),
                             tf.keras.layers.Dense(1)])
    return m


def same_on_every_rank(label, arrays):
    for i, a in enumerate(arrays):
        gathered = hvd.allgather(tf.constant(a[None]), name=f"{label}.{i}").numpy()
        for r in range(N):
            close(f"{label}: weight {i} rank {r} vs rank 0", gathered[r], gathered[0])


@check("tf.keras is tf_keras, and the faces follow it")
def _():
    if not tf.keras.Model.__module__.startswith("tf_keras"):
        FAILS.append(f"tf.keras is not tf_keras: {tf.keras.Model.__module__}")
    for cb in (hk.callbacks.BroadcastGlobalVariablesCallback(0), hk.callbacks.MetricAverageCallback(),
               htk.callbacks.LearningRateWarmupCallback(0.1)):
        if not isinstance(cb, tf.keras.callbacks.Callback):
            FAILS.append(f"{type(cb).__name__} is not a tf_keras Callback")
    if hk.callbacks.BroadcastGlobalVariablesCallback is not htk.callbacks.BroadcastGlobalVariablesCallback:
        FAILS.append("hvd_magic.tensorflow.keras is not hvd_magic.keras")


@check("fit: DistributedOptimizer + callbacks == single-process SGD on all ranks' batches")
def _():
    m = model(seed=R)             # different start on every rank: the callback makes it rank 0's
    opt = hk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9))
    if not isinstance(opt, tf.keras.optimizers.SGD) or len(opt.variables()) != len(opt.variables):
        FAILS.append("the wrapped tf_keras optimizer lost its class or opt.variables()")
    m.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    x, y = data(R)
    hist = m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                 callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0),
                            hk.callbacks.MetricAverageCallback()])
    same_on_every_rank("fit", m.get_weights())
    same_on_every_rank("fit momentum slots", [v.numpy() for v in opt.variables()[1:]])
    losses = hvd.allgather(tf.constant([hist.history["loss"]]), name="fit.loss").numpy()
    close("MetricAverageCallback: same logged loss on every rank", losses, np.repeat(losses[:1], N, 0))

    ref = model(seed=0)           # rank 0's start, every rank's batch i side by side
    ref.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    parts = [data(r) for r in range(N)]
    xs = np.concatenate([np.concatenate([p[0][i * BATCH:(i + 1) * BATCH] for p in parts])
                         for i in range(STEPS)])
    ys = np.concatenate([np.concatenate([p[1][i * BATCH:(i + 1) * BATCH] for p in parts])
                         for i in range(STEPS)])
    ref.fit(xs, ys, batch_size=BATCH * N, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(m.get_weights(), ref.get_weights())):
        close(f"fit weight {i} vs single process", a, b, atol=1e-5)


@check("fit of a model given no input shape (built by its first batch, as in the examples)")
def _():
    tf.keras.utils.set_random_seed(30 + R)
    m = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)])
    m.compile(optimizer=hk.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)), loss="mse")
    x, y = data(R)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
          callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank("unbuilt model", m.get_weights())


@check("fit with a tf_keras legacy optimizer and LearningRateWarmupCallback")
def _():
    m = model(seed=10 + R)
    opt = hk.DistributedOptimizer(tf.keras.optimizers.legacy.Adam(0.01))
    m.compile(optimizer=opt, loss="mse")
    x, y = data(R)
    hist = m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                 callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0),
                            hk.callbacks.LearningRateWarmupCallback(0.01, warmup_epochs=1)])
    same_on_every_rank("legacy Adam", m.get_weights())
    close("warmup ends at initial_lr", hist.history["lr"][-1], 0.01)
    if len(opt.variables()) < 3:
        FAILS.append(f"legacy optimizer variables(): {len(opt.variables())}")


@check("backward_passes_per_step=2: applied every 2nd pass with the reduced sum")
def _():
    w = tf.Variable([0.0])
    opt = hk.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    g = tf.constant([float(R + 1)])
    opt.apply_gradients([(g, w)])
    close("after pass 1 (not applied)", w.numpy(), [0.0])
    opt.apply_gradients([(g, w)])
    close("after pass 2 (two passes summed, averaged over ranks)", w.numpy(), [-2 * (N + 1) / 2])
    close("iterations count every pass", opt.iterations.numpy(), 2)


@check("DistributedGradientTape loop, broadcast of opt.variables() (tensorflow2_mnist.py)")
def _():
    m = model(seed=20 + R)
    opt = tf.keras.optimizers.Adam(0.01)
    x, y = data(R)
    for step in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x[:BATCH], training=True) - y[:BATCH]) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        if step == 0:
            hvd.broadcast_variables(m.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
    same_on_every_rank("tape loop", m.get_weights())


finish(hvd)
