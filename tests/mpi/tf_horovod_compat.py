"""hvd_magic.tensorflow where Horovod's TensorFlow tests need its exact behaviour (2 or 3
ranks): error classes (FailedPreconditionError on a mismatch, eagerly and in a TF1 session
graph; InvalidArgumentError on rows that do not split and off a process set), uint16 through allgather / broadcast /
alltoall, grouped_allreduce with tf.IndexedSlices, Horovod's reducescatter gradient scale,
broadcast_global_variables, the broadcast gradient in a session graph on every root.

Usage: mpiexec -n N python tf_horovod_compat.py
Exits nonzero with one line per failed check, prefixed by the rank."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_magic.tensorflow as hvd  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

hvd.init(process_sets="dynamic")   # one check adds a set
R, N = hvd.rank(), hvd.size()


def raises(label, fn, exc_type, *also):
    try:
        fn()
        FAILS.append(f"{label}: no {exc_type.__name__}")
    except exc_type as exc:
        for cls in also:
            if not isinstance(exc, cls):
                FAILS.append(f"{label}: {type(exc).__name__} is no {cls.__name__}")
    hvd.barrier()


@check("mismatch: FailedPreconditionError eagerly and in tf.function")
def _():
    raises("eager allreduce shape", lambda: hvd.allreduce(tf.zeros([R + 1])),
           tf.errors.FailedPreconditionError, hvd.TensorMismatchError)
    raises("eager broadcast root", lambda: hvd.broadcast(tf.zeros([2]), R),
           tf.errors.FailedPreconditionError)
    raises("eager alltoall dtype", lambda: hvd.alltoall(tf.zeros([N], tf.float32 if R else tf.int32)),
           tf.errors.FailedPreconditionError)
    raises("tf.function allgather", tf.function(lambda: hvd.allgather(tf.zeros([1, R + 1]))),
           tf.errors.FailedPreconditionError)
    close("usable after", hvd.allreduce(tf.ones([2])), [1.0, 1.0])


@check("splits: InvalidArgumentError, also a ValueError")
def _():
    raises("alltoall rows not divisible", lambda: hvd.alltoall(tf.ones([N + 1])),
           tf.errors.InvalidArgumentError, ValueError)


@check("a process set this rank is not in: InvalidArgumentError, also a ValueError")
def _():
    first = hvd.add_process_set([0])
    if R != 0:
        try:
            hvd.allreduce(tf.ones([2]), process_set=first)
            FAILS.append("allreduce off the set did not raise")
        except tf.errors.InvalidArgumentError as exc:
            if not isinstance(exc, ValueError) or "process set" not in str(exc):
                FAILS.append(f"allreduce off the set: {type(exc).__name__}: {exc}")
    hvd.remove_process_set(first)


@check("uint16 through allgather, broadcast, alltoall, grouped_allgather")
def _():
    x = tf.constant([60000 + R, R], tf.uint16)
    g = hvd.allgather(x)
    close("allgather uint16", g, np.ravel([[60000 + r, r] for r in range(N)]))
    if g.dtype != tf.uint16:
        FAILS.append(f"allgather uint16 came back as {g.dtype}")
    close("broadcast uint16", hvd.broadcast(x, 0), [60000, 0])
    close("alltoall uint16", hvd.alltoall(tf.fill([N], tf.constant(65535 - R, tf.uint16))),
          [65535 - r for r in range(N)])
    close("grouped_allgather uint16", hvd.grouped_allgather([x])[0], g)
    close("tf.function allgather uint16", tf.function(lambda: hvd.allgather(x))(), g)


@check("grouped_allreduce with tf.IndexedSlices, as Horovod")
def _():
    s = tf.IndexedSlices(tf.constant([[1.0 + R]]), tf.constant([R]), dense_shape=tf.constant([N, 1]))
    d = tf.constant([2.0 * R])
    out = hvd.grouped_allreduce([s, d], op=hvd.Sum)
    if not isinstance(out[0], tf.IndexedSlices):
        FAILS.append(f"grouped_allreduce gave {type(out[0]).__name__} for IndexedSlices")
    close("sparse values", out[0].values, [[1.0 + r] for r in range(N)])
    close("sparse indices", out[0].indices, list(range(N)))
    close("dense member", out[1], [2.0 * sum(range(N))])
    avg = hvd.grouped_allreduce([s])[0]
    close("sparse average", avg.values, [[(1.0 + r) / N] for r in range(N)])
    raises("sparse Max", lambda: hvd.grouped_allreduce([s], op=hvd.Max), NotImplementedError)


@check("reducescatter gradient scaled as Horovod (Sum: times size)")
def _():
    w = tf.Variable(tf.ones([2 * N, 3]))
    for op, want in ((hvd.Sum, N), (hvd.Average, 1.0)):
        with tf.GradientTape() as tape:
            y = hvd.reducescatter(w, op=op)
        close(f"reducescatter grad {op}", tape.gradient(y, w), np.full([2 * N, 3], want))
        with tf.GradientTape() as tape:
            y = hvd.grouped_reducescatter([w], op=op)[0]
        close(f"grouped_reducescatter grad {op}", tape.gradient(y, w), np.full([2 * N, 3], want))


@check("_executing_eagerly, broadcast_global_variables eagerly")
def _():
    if not (hvd._executing_eagerly() and hvd.util._executing_eagerly()):
        FAILS.append("_executing_eagerly() is False eagerly")
    if tf.function(lambda: tf.constant(hvd._executing_eagerly()))().numpy():
        FAILS.append("_executing_eagerly() is True while tracing")
    raises("broadcast_global_variables eagerly", lambda: hvd.broadcast_global_variables(0),
           RuntimeError)


@check("TF1 session graph: mismatch, broadcast gradient on every root, global variables")
def _():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        bad = hvd.allreduce(tf.zeros([R + 1]), name="compat.graph")
        try:
            sess.run(bad)
            FAILS.append("session mismatch did not raise")
        except tf.errors.FailedPreconditionError as exc:
            if "compat.graph" not in str(exc):
                FAILS.append(f"session mismatch message lacks the name: {exc}")
    for root in range(N):
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            t = tf.ones([3]) * R
            g = tf.gradients(hvd.broadcast(t, root), t, tf.ones([3]))[0]
            close(f"session broadcast grad root {root}", sess.run(g), [1.0 if R == root else 0.0] * 3)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        v = tf.compat.v1.Variable([float(R), 1.0])
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))
        close("broadcast_global_variables", sess.run(v), [0.0, 1.0])


finish(hvd)
