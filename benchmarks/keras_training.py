"""Keras 3 CNN training throughput: hvd_magic.keras at 1 and 2 ranks beside TensorFlow's
own MultiWorkerMirroredStrategy (2 workers on 127.0.0.1), synthetic 32x32x3 images, one
intra-op and one inter-op thread per rank.

    .venv/bin/python benchmarks/keras_training.py              # driver: alternate, repeat, table
    .venv/bin/python benchmarks/keras_training.py --repeats 5 --steps 60

Scaling efficiency = 2-rank throughput / (2 x 1-rank throughput). The hvd_magic rows use
the 1-rank hvd_magic run as baseline; the MWMS rows run the same model, loss and optimizer
in a custom loop (Keras 3's fit() rejects MWMS's per-replica batches) with the 1-worker
strategy as baseline; plain single-process ``model.fit`` is shown for reference. Configurations run one after another in turn,
``--repeats`` times, and the table shows medians (the machine is shared and noisy). Ranks
are pinned one per core (mpiexec's default binding; ``taskset`` for the MWMS workers).
Prints ``OK``/``MISS`` lines for the targets: efficiency >= 0.85 and >= MWMS's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
MPIEXEC = str(Path(PY).with_name("mpiexec"))
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,sm", "PYTHONUNBUFFERED": "1",
       "OMP_NUM_THREADS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


# ---------------------------------------------------------------- worker side
def _model(keras):
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def worker(mode: str, batch: int, steps: int, window: int) -> None:
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    rank, size = 0, 1
    strategy = None
    if mode == "hvd":
        import hvd_magic.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if "TF_CONFIG" in os.environ else 0
        size = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(rank)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(batch * 8, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch * 8,)).astype("int64")
    # MWMS splits each worker's dataset batch over all replicas: feed batch * size per worker
    per_worker = batch * size if mode == "mwms" else batch
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_worker, drop_remainder=True)
    if mode == "mwms":
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(opts)   # each worker feeds its own synthetic data
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build():
        model = _model(keras)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        cbs = []
        if mode == "hvd":
            opt = hvd.DistributedOptimizer(opt)
            cbs.append(hvd.callbacks.BroadcastGlobalVariablesCallback(0))
        model.compile(optimizer=opt, loss=loss, jit_compile=False)
        return model, cbs

    warm = 5
    stamps: list = []
    if strategy is None:
        model, cbs = build()

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, b, logs=None):
                stamps.append(time.perf_counter())

        model.fit(ds, steps_per_epoch=warm + steps, epochs=1, verbose=0, callbacks=cbs + [Clock()])
    else:
        # Keras 3's fit() cannot take MultiWorkerMirroredStrategy's per-replica batches
        # (ValueError converting PerReplica to a Tensor), so the strategy runs the same model,
        # loss and optimizer in a custom loop, the way TensorFlow documents it.
        with strategy.scope():
            model, _ = build()
            model.optimizer.build(model.trainable_variables)
        dist = iter(strategy.experimental_distribute_dataset(ds))

        @tf.function
        def step(batch):
            def replica_step(xb, yb):
                with tf.GradientTape() as tape:
                    l = tf.reduce_mean(loss(yb, model(xb, training=True)))
                grads = tape.gradient(l, model.trainable_variables)
                model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return l
            return strategy.run(replica_step, args=batch)

        for _ in range(warm + steps):
            step(next(dist))
            stamps.append(time.perf_counter())
    t = stamps[warm - 1:]
    rates = [window * batch * size / (t[i + window] - t[i]) for i in range(0, len(t) - window, window)]
    if rank == 0:
        print("RESULT " + json.dumps({"mode": mode, "size": size,
                                      "images_per_s": statistics.median(rates)}), flush=True)
    if mode == "hvd":
        hvd.shutdown()


# ---------------------------------------------------------------- driver side
def _free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _result(out: str) -> float:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return float(json.loads(line[7:])["images_per_s"])
    raise RuntimeError("no RESULT line in the output:\n" + out[-3000:])


def run_config(name: str, args: argparse.Namespace) -> tuple:
    """(images/s or None, error text)."""
    me = [str(HERE / "keras_training.py"), "--batch", str(args.batch), "--steps", str(args.steps),
          "--window", str(args.window)]
    env = dict(os.environ, **ENV)
    try:
        if name in ("hvd1", "hvd2"):
            n = 1 if name == "hvd1" else 2
            p = subprocess.run([MPIEXEC, "-n", str(n), PY, *me, "--worker", "hvd"], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            return _result(p.stdout + p.stderr), ""
        if name in ("plain1", "mwms1"):
            p = subprocess.run(["taskset", "-c", "0", PY, *me, "--worker", name[:-1]], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            return _result(p.stdout + p.stderr), ""
        ports = _free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        procs = []
        for i in range(2):
            e = dict(env, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
            procs.append(subprocess.Popen(["taskset", "-c", str(i % (os.cpu_count() or 1)), PY, *me,
                                           "--worker", "mwms"], env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=args.timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0] + "\n(timed out)")
        return _result(outs[0]), ""
    except Exception as exc:  # noqa: BLE001 - report why a configuration did not run
        return None, f"{type(exc).__name__}: {exc}"


def driver(args: argparse.Namespace) -> int:
    configs = ["plain1", "hvd1", "hvd2", "mwms1", "mwms2"]
    results: dict = {c: [] for c in configs}
    errors: dict = {}
    for rep in range(args.repeats):
        order = configs if rep % 2 == 0 else configs[::-1]   # alternate, so drifts hit all alike
        for c in order:
            rate, err = run_config(c, args)
            if rate is None:
                errors[c] = err
            else:
                results[c].append(rate)
            print(f"  repeat {rep + 1} {c:7s} " + (f"{rate:8.1f} images/s" if rate else "failed"),
                  flush=True)
    med = {c: statistics.median(v) if v else None for c, v in results.items()}
    print(f"\nKeras CNN (32x32x3, conv32-conv64-dense128), batch {args.batch} per rank, "
          f"1 intra-op + 1 inter-op thread per rank, medians of {args.repeats} runs "
          f"(each the median of {args.steps // args.window} windows of {args.window} steps)\n")
    print(f"{'configuration':34s} {'images/s':>9s} {'efficiency':>10s}   runs")
    rows = [("plain Keras, 1 process", "plain1", None), ("hvd_magic.keras, 1 rank", "hvd1", None),
            ("hvd_magic.keras, 2 ranks", "hvd2", "hvd1"), ("MultiWorkerMirrored, 1 worker", "mwms1", None),
            ("MultiWorkerMirrored, 2 workers", "mwms2", "mwms1")]
    eff: dict = {}
    for label, c, base in rows:
        e = ""
        if base and med[c] and med[base]:
            eff[c] = med[c] / (2 * med[base])
            e = f"{eff[c]:.2f}"
        rate = f"{med[c]:9.1f}" if med[c] else "   failed"
        print(f"{label:34s} {rate} {e:>10s}   {', '.join(f'{v:.0f}' for v in results[c])}")
    for c, err in errors.items():
        print(f"\n{c} failed: {err[-1500:]}")
    h = eff.get("hvd2")
    if h is None:
        print("MISS hvd_magic 2-rank efficiency: not measured")
        return 1
    print(f"{'OK' if h >= 0.85 else 'MISS'} hvd_magic 2-rank efficiency {h:.2f} (target >= 0.85)")
    m = eff.get("mwms2")
    if m is not None:
        print(f"{'OK' if h >= m else 'MISS'} hvd_magic efficiency {h:.2f} vs MultiWorkerMirrored {m:.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["hvd", "mwms", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32, help="images per rank per step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run (after 5 warm-up)")
    ap.add_argument("--window", type=int, default=10, help="steps per timing window")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.batch, args.steps, args.window)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
