"""Keras model.fit inside hvd.elastic.run with Horovod's elastic callbacks, under
`hvdrun --min-np`: the last rank SIGKILLs itself in epoch 1; the survivors restore the last
commit and finish the remaining epochs on one rank fewer; their weights agree.

usage: elastic_keras.py   (prints 'elastic keras OK' on each surviving rank)"""
import os
import signal
import sys
import time

import numpy as np
import keras

import hvd_magic.keras as hvd
from hvd_magic.keras import elastic

hvd.init()
world = hvd.size()
N, EPOCHS, BATCH = 96, 3, 4
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 8)).astype("float32")
Y = X @ rng.normal(size=(8, 1)).astype("float32")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
state = elastic.KerasState(model, epoch=0, batch=0)
marks = {}


class Kill(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if "lost" in marks and "resumed" not in marks:
            marks["resumed"] = time.time()
        if (state.epoch, batch, hvd.rank(), hvd.size()) == (1, 3, world - 1, world):
            print(f"KILL {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    x, y = X[hvd.rank()::hvd.size()], Y[hvd.rank()::hvd.size()]   # this size's shard
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, verbose=0, shuffle=False,
              callbacks=[Kill(), elastic.CommitStateCallback(state, batches_per_commit=2),
                         elastic.UpdateBatchStateCallback(state),
                         elastic.UpdateEpochStateCallback(state)])


state.register_reset_callbacks([lambda: marks.setdefault("lost", time.time())])
train(state)
fails = []
if hvd.size() != world - 1:
    fails.append(f"ended on {hvd.size()} ranks, not {world - 1}")
if state.epoch != EPOCHS:
    fails.append(f"state.epoch is {state.epoch}, not {EPOCHS}")
w = np.concatenate([v.numpy().ravel() for v in model.weights])
everyone = hvd.allgather_object(w)
if any(not np.allclose(everyone[0], o) for o in everyone):
    fails.append(f"ranks' weights differ: {everyone}")
loss = float(model.evaluate(X, Y, verbose=0))
if not loss < float(np.mean(Y ** 2)):
    fails.append(f"loss {loss} did not go down")
if hvd.rank() == 0 and "resumed" in marks:
    print(f"RESUMED {marks['resumed']:.3f}", flush=True)
for f in fails:
    print(f"rank {hvd.rank()}: FAIL {f}", flush=True)
print("elastic keras OK" if not fails else "elastic keras FAILED", flush=True)
sys.exit(1 if fails else 0)
