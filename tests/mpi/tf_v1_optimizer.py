"""hvd.DistributedOptimizer of horovod.tensorflow around a tf.compat.v1.train optimizer, in a
TF1 graph run by a Session, at any number of ranks: each rank trains on its shard of one
batch; the weights equal one process training on the whole batch, on every rank.

- minimize() with GradientDescentOptimizer, 3 steps;
- compute_gradients() returns the averaged gradients, apply_gradients() applies them;
- backward_passes_per_step=2 with a global_step: applied on every second pass (the sum of
  the two passes' averaged gradients), global_step counts every pass, as in Horovod;
- register_local_var: that variable's gradient stays local, divided by the number of ranks;
- op=hvd.Adasum: each rank's own step, then the ranks' changes combined with Adasum.

usage: tf_v1_optimizer.py   (each rank prints 'done, 0 failures')"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_magic.tensorflow as hvd  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

tf.compat.v1.disable_eager_execution()
hvd.init()
n, r = hvd.size(), hvd.rank()
rng = np.random.default_rng(0)
X = rng.normal(size=(4 * n, 3)).astype("float32")
Y = X @ rng.normal(size=(3, 1)).astype("float32")
W0 = rng.normal(size=(3, 1)).astype("float32")
mine = slice(4 * r, 4 * (r + 1))
LR = 0.1


def reference(steps, passes=1):
    """One process on the whole batch: ``steps`` updates, each with ``passes`` times the
    gradient (the sum of that many equal passes)."""
    w = W0.astype(np.float64)
    for _ in range(steps):
        grad = 2 * X.T @ (X @ w - Y) / len(X)
        w = w - LR * passes * grad
    return w


def model(graph):
    with graph.as_default():
        # each rank starts elsewhere: equal results come of the broadcast
        w = tf.compat.v1.get_variable("w", initializer=W0 + r)
        x, y = tf.constant(X[mine]), tf.constant(Y[mine])
        loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
    return w, loss


@check("minimize")
def _():
    g = tf.Graph()
    w, loss = model(g)
    with g.as_default():
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
        if not isinstance(opt, tf.compat.v1.train.Optimizer):
            FAILS.append(f"minimize: {type(opt)} is no tf.compat.v1.train.Optimizer")
        train = opt.minimize(loss)
        init, bcast = tf.compat.v1.global_variables_initializer(), hvd.broadcast_global_variables(0)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        sess.run(bcast)
        for _ in range(3):
            sess.run(train)
        got = sess.run(w)
    close("minimize: weights vs one process", got, reference(3), atol=1e-5)
    everyone = hvd.allgather_object(got.tolist(), name="minimize")
    close("minimize: rank 0 vs this rank", everyone[0], got, atol=0)


@check("compute_gradients")
def _():
    g = tf.Graph()
    w, loss = model(g)
    with g.as_default():
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), name="cg")
        pairs = opt.compute_gradients(loss, var_list=[w])
        apply = opt.apply_gradients(pairs)
        init, bcast = tf.compat.v1.global_variables_initializer(), hvd.broadcast_global_variables(0)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        sess.run(bcast)
        grad = sess.run(pairs[0][0])
        sess.run(apply)
        got = sess.run(w)
    close("compute_gradients: averaged gradient", grad,
          2 * X.T @ (X @ W0 - Y) / len(X), atol=1e-5)
    close("compute_gradients: weights", got, reference(1), atol=1e-5)


@check("backward_passes_per_step")
def _():
    g = tf.Graph()
    w, loss = model(g)
    with g.as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                       backward_passes_per_step=2, name="agg")
        train = opt.minimize(loss, global_step=step)
        init, bcast = tf.compat.v1.global_variables_initializer(), hvd.broadcast_global_variables(0)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        sess.run(bcast)
        seen = []
        for _ in range(4):
            sess.run(train)
            seen.append(sess.run(w))
        steps = sess.run(step)
    close("backward_passes_per_step: not applied on the first pass", seen[0], W0, atol=0)
    close("backward_passes_per_step: weights after 4 passes", seen[3], reference(2, passes=2),
          atol=1e-4)
    if steps != 4:
        FAILS.append(f"backward_passes_per_step: global_step {steps}, not 4")


@check("register_local_var")
def _():
    g = tf.Graph()
    w, loss = model(g)
    with g.as_default():
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), name="loc")
        opt.register_local_var(w)
        (grad, _v), = opt.compute_gradients(loss, var_list=[w])
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        got = sess.run(grad)
    w_here = W0 + r
    local = 2 * X[mine].T @ (X[mine] @ w_here - Y[mine]) / 4
    close("register_local_var: local gradient / size", got, local / n, atol=1e-5)


@check("Adasum")
def _():
    import hvd_magic.collectives as C
    g = tf.Graph()
    w, loss = model(g)
    with g.as_default():
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                       op=hvd.Adasum)
        train = opt.minimize(loss)
        init, bcast = tf.compat.v1.global_variables_initializer(), hvd.broadcast_global_variables(0)
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(init)
        sess.run(bcast)
        want = W0.copy()
        for step in range(2):
            sess.run(train)
            # this rank's own SGD step, the ranks' changes combined with Adasum
            delta = -LR * 2 * X[mine].T @ (X[mine] @ want - Y[mine]) / 4
            want = want + C.allreduce(delta.astype(np.float32), op=C.Adasum, name=f"ref{step}")
            close(f"Adasum: weights after step {step + 1}", sess.run(w), want, atol=1e-5)


finish(hvd)
