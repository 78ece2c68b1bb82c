"""A Horovod-style Keras 3 training script (only the import differs from
horovod.tensorflow.keras): an MLP on scikit-learn's 8x8 digits (bundled, nothing
downloaded), each rank fitting its own shard.

Usage: mpiexec -n 2 python tf_digits.py
Prints "accuracy <test accuracy>" on rank 0."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hvd_magic.keras as hvd  # noqa: E402

hvd.init()
keras.utils.set_random_seed(42 + hvd.rank())   # ranks start apart; the callback aligns them

digits = load_digits()
X = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
perm = np.random.default_rng(0).permutation(len(X))
train_idx, test_idx = perm[:1400], perm[1400:]
mine = train_idx[hvd.rank()::hvd.size()]           # each rank trains on its own shard

model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(10)])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9))
model.compile(optimizer=opt, metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(X[mine], y[mine], batch_size=32, epochs=10, shuffle=True, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback()])

part = test_idx[hvd.rank()::hvd.size()]
pred = np.argmax(model.predict(X[part], verbose=0), axis=1)
counts = hvd.allreduce(tf.constant([float((pred == y[part]).sum()), float(len(part))]), op=hvd.Sum)
if hvd.rank() == 0:
    print(f"accuracy {float(counts[0] / counts[1]):.4f}", flush=True)
hvd.shutdown()
