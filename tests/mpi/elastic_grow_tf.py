"""A TensorFlow job growing from 1 rank to 2 at a commit, under `hvdrun -np 1 --min-np 1
--max-np 2 --host-discovery-script S` (S prints the file SLOTS, 1 slot at the start). After
2 steps rank 0 writes 2 slots there: at the next commit a second rank is spawned and joins.
The training step was traced (tf.function, or Keras' train function) while the job had one
rank, and runs on after the growth: it must reduce the gradients with the new rank.

MODE ``tape``: a ``tf.function`` step with ``hvd.DistributedGradientTape``; at the end, on
both ranks, the weights equal one process replaying the same global batches (rank 0's first
weights; each rank starts from different ones, so equal weights come of the syncs).
MODE ``keras``: ``model.fit`` of a model with a ``SyncBatchNormalization`` layer, with the
Keras ``DistributedOptimizer`` (Adam) and Horovod's elastic callbacks; at the end, both ranks hold
the same weights (moving statistics included) and the loss went down.

usage: elastic_grow_tf.py SLOTS MODE   (prints 'elastic tf OK' on each rank; 'JOINED' on the
new rank)"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_magic.tensorflow as hvd  # noqa: E402

hvd.init()
SLOTS, MODE = sys.argv[1], sys.argv[2]
N, BATCH, STEPS, GROW_AT, LR = 64, 4, 8, 2, 0.05
joined = hvd.size() == 2              # only a spawned rank starts with 2
if joined:
    print(f"JOINED as rank {hvd.rank()}", flush=True)
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 4)).astype("float32")
Y = X @ rng.normal(size=(4, 1)).astype("float32")
fails = []


def grow_at_commit(done: int) -> None:
    """Rank 0, before the commit after ``done`` steps: ask the discovery script for 2 slots."""
    if done == GROW_AT and hvd.rank() == 0:
        with open(SLOTS, "w") as fh:
            fh.write("localhost:2\n")
        time.sleep(1.1)        # the script is asked at most once a second


def same_everywhere(values: list, label: str) -> None:
    everyone = hvd.allgather_object([np.asarray(v).ravel().tolist() for v in values], name=label)
    if any(not np.allclose(np.concatenate(everyone[0]), np.concatenate(o)) for o in everyone):
        fails.append(f"{label}: the ranks' weights differ: {everyone}")


def initial_weights(seed: int) -> list:
    return [tf.random.stateless_normal((4, 1), seed=(1, seed)), tf.zeros((1,))]


if MODE == "tape":
    w, b = [tf.Variable(v) for v in initial_weights(hvd.rank() + 10 * joined)]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, w) + b - y) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)
        return loss

    state = hvd.elastic.TensorFlowState([w, b], step=0, steps=[])
    size_now = tf.function(lambda: hvd.size_op())
    size_now()                        # traced here: on 1 rank on rank 0

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            same_everywhere([w, b], f"before step {state.step}")
            mine = [(state.step * 2 * BATCH + hvd.rank() * BATCH + i) % N for i in range(BATCH)]
            step(tf.constant(X[mine]), tf.constant(Y[mine]))
            state.steps.append(hvd.allgather_object(mine, name="indices"))
            state.step += 1
            if state.step % 2 == 0:
                grow_at_commit(state.step)
                state.commit()

    train(state)
    sizes = [len(parts) for parts in state.steps]
    if sizes != [1] * GROW_AT + [2] * (STEPS - GROW_AT):
        fails.append(f"ranks per step {sizes}, not 1 for {GROW_AT} steps then 2")
    rw, rb = [tf.Variable(v) for v in initial_weights(0)]
    for parts in state.steps:         # one process, the mean loss of the ranks' batches
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_mean((tf.matmul(X[p], rw) + rb - Y[p]) ** 2)
                             for p in parts]) / len(parts)
        gw, gb = tape.gradient(loss, [rw, rb])
        rw.assign_sub(LR * gw)
        rb.assign_sub(LR * gb)
    if not (np.allclose(w.numpy(), rw.numpy(), atol=1e-5) and np.allclose(b.numpy(), rb.numpy(), atol=1e-5)):
        fails.append(f"weights differ from the replay: {w.numpy().ravel()} {b.numpy()} vs "
                     f"{rw.numpy().ravel()} {rb.numpy()}")
    same_everywhere([w, b], "at the end")
    if int(size_now()) != 2:
        fails.append(f"size_op() in a function traced before the growth: {int(size_now())}, not 2")
else:
    import keras

    import hvd_magic.keras as hvd_keras
    from hvd_magic.keras import elastic

    keras.utils.set_random_seed(hvd.rank() + 10 * joined)
    # SyncBatchNormalization too: at one rank it must still combine the statistics in a
    # train function that runs on after the growth
    model = keras.Sequential([keras.Input((4,)), hvd.SyncBatchNormalization(),
                              keras.layers.Dense(1)])
    # Adam: the joined rank's optimizer has no slots before its first step
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    # the loss of rank 0's first weights (a joined rank gets it with the first sync)
    state = elastic.KerasState(model, epoch=0, batch=0, sizes=[],
                               start_loss=float(model.evaluate(X, Y, verbose=0)))

    class Grow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state.sizes.append(hvd.size())
            grow_at_commit(batch + 1 if state.epoch == 0 and hvd.size() == 1 else -1)

    @elastic.run
    def train(state):
        x, y = X[hvd.rank()::hvd.size()], Y[hvd.rank()::hvd.size()]   # this size's shard
        model.fit(x, y, batch_size=BATCH, epochs=2 - state.epoch, verbose=0, shuffle=False,
                  callbacks=[Grow(), elastic.CommitStateCallback(state, batches_per_commit=2),
                             elastic.UpdateBatchStateCallback(state),
                             elastic.UpdateEpochStateCallback(state)])

    train(state)
    if state.sizes[:GROW_AT] != [1] * GROW_AT or 2 not in state.sizes:
        fails.append(f"ranks per step {state.sizes}: not 1 then 2")
    same_everywhere(model.weights, "at the end")
    after = float(model.evaluate(X, Y, verbose=0))
    if not after < state.start_loss:
        fails.append(f"loss {after} did not go down from {state.start_loss}")

if hvd.size() != 2:
    fails.append(f"ended on {hvd.size()} ranks, not 2")
for f in fails:
    print(f"rank {hvd.rank()}: FAIL {f}", flush=True)
print("elastic tf OK" if not fails else "elastic tf FAILED", flush=True)
hvd.shutdown()
sys.exit(1 if fails else 0)
