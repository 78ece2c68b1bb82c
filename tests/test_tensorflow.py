"""hvd_magic.tensorflow and hvd_magic.keras (TensorFlow >= 2.16; Keras 3, and Keras 2 as tf_keras
under TF_USE_LEGACY_KERAS=1). Multi-rank checks run under real mpiexec at 2 and 3 ranks
(tests/mpi/tf_checks.py groups them, one launch per rank count, because importing TensorFlow
costs seconds per launch)."""
import inspect
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import hvd_magic.keras as hk  # noqa: E402
import hvd_magic.tensorflow as hvd  # noqa: E402
from mpi_harness import mpirun  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}

HOROVOD_TF_NAMES = """init shutdown size rank local_rank local_size cross_rank cross_size is_initialized
mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built
cuda_built rocm_built is_homogeneous start_timeline stop_timeline join barrier broadcast_object
allgather_object allreduce grouped_allreduce allgather broadcast alltoall reducescatter
broadcast_variables DistributedGradientTape Compression Average Sum Adasum Min Max Product
HorovodInternalError ProcessSet global_process_set add_process_set remove_process_set""".split()
HOROVOD_TF_ONLY = """grouped_allgather grouped_reducescatter broadcast_ broadcast_object_fn size_op
process_set_included_op local_size_op rank_op local_rank_op SyncBatchNormalization
LocalGradientAggregationHelper DistributedOptimizer gpu_available""".split()

# horovod.tensorflow 0.28's parameters, in order (hvd_magic may add parameters after them)
HOROVOD_TF_SIGNATURES = {
    "allreduce": "tensor average device_dense device_sparse compression op prescale_factor "
                 "postscale_factor name process_set ignore_name_scope",
    "grouped_allreduce": "tensors average device_dense device_sparse compression op prescale_factor "
                         "postscale_factor process_set ignore_name_scope name",
    "allgather": "tensor name ignore_name_scope process_set",
    "grouped_allgather": "tensors name ignore_name_scope process_set",
    "broadcast": "tensor root_rank name ignore_name_scope process_set",
    "broadcast_": "variables root_rank name process_set",
    "alltoall": "tensor splits name ignore_name_scope process_set",
    "reducescatter": "tensor device_dense compression op name process_set ignore_name_scope "
                     "prescale_factor postscale_factor",
    "grouped_reducescatter": "tensors device_dense compression op process_set prescale_factor "
                             "postscale_factor",
    "broadcast_variables": "variables root_rank process_set inplace",
    "broadcast_object": "obj root_rank session name process_set",
    "broadcast_object_fn": "root_rank session name process_set",
    "allgather_object": "obj session name process_set",
    "size_op": "process_set_id name",
    "process_set_included_op": "process_set_id name",
    "DistributedOptimizer": "optimizer name use_locking device_dense device_sparse compression "
                            "sparse_as_dense backward_passes_per_step op gradient_predivide_factor "
                            "average_aggregated_gradients num_groups groups process_set "
                            "scale_local_gradients",
    "gpu_available": "ext_base_name verbose",
}


def test_public_names():
    assert not [n for n in HOROVOD_TF_NAMES + HOROVOD_TF_ONLY if not hasattr(hvd, n)]
    assert not [n for n in HOROVOD_TF_NAMES + ["DistributedOptimizer", "PartialDistributedOptimizer",
                                               "load_model", "callbacks"]
                if n != "DistributedGradientTape" and not hasattr(hk, n)]
    assert hk.ProcessSet is hvd.ProcessSet and hk.global_process_set is hvd.global_process_set
    # names Horovod does not have, added here by mistake once
    assert not [n for n in ("cross_size_op", "cross_rank_op") if hasattr(hvd, n) or hasattr(hk, n)]
    for cb in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
               "LearningRateScheduleCallback", "BestModelCheckpoint"):
        assert hasattr(hk.callbacks, cb)
    import hvd_magic.tensorflow.keras as alias
    assert alias.DistributedOptimizer is hk.DistributedOptimizer


def test_signatures_match_horovod():
    params = inspect.signature(hvd.DistributedGradientTape).parameters
    assert list(params) == ["gradtape", "device_dense", "device_sparse", "compression",
                            "sparse_as_dense", "op", "gradient_predivide_factor", "num_groups", "groups",
                            "process_set", "scale_local_gradients"]
    params = inspect.signature(hk.DistributedOptimizer).parameters
    assert list(params) == ["optimizer", "name", "device_dense", "device_sparse", "compression",
                            "sparse_as_dense", "gradient_predivide_factor", "op",
                            "backward_passes_per_step", "average_aggregated_gradients",
                            "num_groups", "groups", "process_set", "scale_local_gradients"]
    assert list(inspect.signature(hk.load_model).parameters) == ["filepath", "custom_optimizers",
                                                                 "custom_objects", "compression"]
    # horovod.tensorflow.keras's own collectives: name second, any tensor-compatible value
    keras_face = {"allreduce": "value name average prescale_factor postscale_factor op compression",
                  "allgather": "value name", "broadcast": "value root_rank name",
                  "reducescatter": "value name op"}
    for name, want in keras_face.items():
        assert list(inspect.signature(getattr(hk, name)).parameters) == want.split(), name
    for name, want in HOROVOD_TF_SIGNATURES.items():
        params = inspect.signature(getattr(hvd, name)).parameters
        assert list(params)[:len(want.split())] == want.split(), name
        if "process_set" in params:
            assert params["process_set"].default is hvd.global_process_set, name
        if "ignore_name_scope" in params:
            assert params["ignore_name_scope"].default is False, name
    assert list(inspect.signature(hvd.grouped_reducescatter).parameters)[-1] == "name"


def test_compression_dtypes():
    t = tf.constant([1.0, 2.0])
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == tf.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == tf.float32
    assert hvd.Compression.bf16.compress(t)[0].dtype == tf.bfloat16
    i = tf.constant([1, 2])
    assert hvd.Compression.fp16.compress(i)[0].dtype == tf.int32




def test_single_process(one_rank):
    """One rank (no mpiexec): the faces reduce to plain TensorFlow / Keras."""
    x = tf.constant([1.0, 2.0])
    assert hvd.allreduce(x).numpy().tolist() == [1.0, 2.0]
    w = tf.Variable([3.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    assert hvd.DistributedGradientTape(tape).gradient(loss, w).numpy().tolist() == [6.0]
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.SGD) and hk.is_distributed(opt)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse")
    model.fit(tf.ones([4, 2]), tf.ones([4, 1]), epochs=1, verbose=0,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hk.callbacks.MetricAverageCallback()])
    assert int(opt.iterations.numpy()) == 1
    assert hk.allreduce([1.0, 2.0], "one_rank").numpy().tolist() == [1.0, 2.0]
    assert int(hk.broadcast(5, 0, "epoch")) == 5


def test_tensorflow_distributed_optimizer_one_rank(one_rank):
    """horovod.tensorflow's DistributedOptimizer: a tf.compat.v1.train optimizer is wrapped in
    one of that base class; a Keras optimizer gets the Keras DistributedOptimizer, as Horovod
    does; refusals say what to use instead."""
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    assert isinstance(opt, tf.compat.v1.train.Optimizer) and opt.get_name() == \
        "DistributedGradientDescentOptimizer"
    w = tf.Variable([3.0])
    (grad, var), = opt.compute_gradients(lambda: tf.reduce_sum(w * w), var_list=[w])
    assert var is w and grad.numpy().tolist() == [6.0]
    opt.apply_gradients([(grad, var)])
    assert w.numpy().tolist() == pytest.approx([2.4])
    keras_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum)
    assert isinstance(keras_opt, keras.optimizers.SGD) and hk.is_distributed(keras_opt)
    ada = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum)
    assert isinstance(ada, tf.compat.v1.train.Optimizer) and ada.get_name() == \
        "DistributedDeltaGradientDescentOptimizer"
    with pytest.raises(ValueError, match="Adasum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match="DistributedGradientTape"):
        hvd.DistributedOptimizer(object())
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), num_groups=2)


def test_gpu_available_is_whether_the_framework_sees_a_gpu(capsys):
    """As Horovod's: a GPU-only check (Horovod's tests skip with ``if not
    hvd.gpu_available('tensorflow')``) skips where the framework sees no GPU (tensorflow-cpu
    here), instead of failing with AttributeError."""
    assert hvd.gpu_available("tensorflow") is bool(tf.config.list_physical_devices("GPU"))
    assert hvd.gpu_available("no_such_framework", verbose=True) is False
    assert "Extension no_such_framework was NOT running with GPU." in capsys.readouterr().out
    torch = pytest.importorskip("torch")
    assert hvd.gpu_available("torch") is torch.cuda.is_available()


def test_indexed_slices_refuses_other_ops_as_horovod(one_rank):
    """Horovod raises NotImplementedError here; hvd_magic's error is also a ValueError."""
    t = tf.IndexedSlices(tf.ones((1, 3)), tf.constant([0]))
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        with pytest.raises(NotImplementedError, match="IndexedSlices"):
            hvd.allreduce(t, op=op)
    with pytest.raises(ValueError, match="postscale_factor"):
        hvd.allreduce(t, postscale_factor=2.0)
    assert hvd.allreduce(t).values.numpy().tolist() == [[1.0, 1.0, 1.0]]


def test_argument_errors(one_rank):
    with pytest.raises(TypeError, match="keras.optimizers"):
        hk.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="Adasum"):
        hk.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum)   # as Horovod's Keras
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hk.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())
    with pytest.raises(ValueError, match="already"):
        hk.DistributedOptimizer(hk.DistributedOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="jit_compile"):
        tf.function(lambda: hvd.allreduce(tf.ones([2])), jit_compile=True)()


def _bn_run(layer, x, mask, graph):
    """Training output, moving statistics and gradients (x, gamma, beta) of sum(y * y)."""
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(y * y * tf.range(1.0, 4.0))
        return [y] + tape.gradient(loss, [x, layer.gamma, layer.beta])
    run = tf.function(step) if graph else step
    outs = [run() for _ in range(2)]
    return [o.numpy() for o in outs[-1]] + [layer.moving_mean.numpy(), layer.moving_variance.numpy()]


def test_sync_batch_norm_one_rank_is_batch_norm(one_rank):
    """At one rank SyncBatchNormalization is BatchNormalization, bit for bit (eager,
    tf.function, with a mask); several ranks are checked under mpiexec (tf_checks.py)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(5, 2, 3)).astype("float32") * 2.0 + 1.0)
    mask = tf.constant(rng.random((5, 2)) > 0.3)
    for graph in (False, True):
        for m in (None, mask):
            sync = hvd.SyncBatchNormalization(momentum=0.8)
            ref = keras.layers.BatchNormalization(momentum=0.8)
            for layer in (sync, ref):
                layer.build(x.shape)
                layer.set_weights([np.array([0.5, 2.0, -1.0], "float32"),
                                   np.array([0.1, 0.0, 0.3], "float32"),
                                   np.zeros(3, "float32"), np.ones(3, "float32")])
            for a, b in zip(_bn_run(sync, x, m, graph), _bn_run(ref, x, m, graph)):
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(sync(x), ref(x))          # inference


def test_sync_batch_norm_arguments():
    """Horovod's constructor (fused=False, then BatchNormalization's); names as Keras gives them."""
    assert list(inspect.signature(hvd.SyncBatchNormalization.__init__).parameters)[1:3] == ["fused", "kwargs"]
    with pytest.raises(ValueError, match="fused=False"):
        hvd.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="fused=False"):
        hvd.SyncBatchNormalization(fused=None)
    layer = hvd.SyncBatchNormalization(axis=1, momentum=0.5, epsilon=1e-2, center=False)
    assert isinstance(layer, keras.layers.BatchNormalization)
    assert layer.name.startswith("sync_batch_normalization")
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(again) is hvd.SyncBatchNormalization
    assert (again.axis, again.momentum, again.epsilon, again.center) == (1, 0.5, 1e-2, False)
    assert not hasattr(hk, "SyncBatchNormalization")     # horovod.tensorflow.keras has none either


def test_sync_batch_norm_totals_combine_ranks():
    """The per-rank [count, sum, sum of squares] summed over "ranks" of different sizes give
    the moments of the whole batch (what the allreduce does), with and without a mask."""
    from hvd_magic.tensorflow.sync_batch_norm import local_totals, moments_from_totals
    rng = np.random.default_rng(1)
    parts = [rng.normal(size=(n, 4, 2)).astype("float32") + 3.0 for n in (1, 3, 6)]
    masks = [rng.random((n, 4)) > 0.4 for n in (1, 3, 6)]
    whole = np.concatenate(parts)
    mean, var = moments_from_totals(sum(local_totals(tf.constant(p), -1, None) for p in parts))
    np.testing.assert_allclose(mean, whole.mean((0, 1)), atol=1e-6)
    np.testing.assert_allclose(var, whole.var((0, 1)), atol=1e-5)
    mean, var = moments_from_totals(sum(local_totals(tf.constant(p), -1, m) for p, m in zip(parts, masks)))
    kept = whole[np.concatenate(masks)]
    np.testing.assert_allclose(mean, kept.mean(0), atol=1e-6)
    np.testing.assert_allclose(var, kept.var(0), atol=1e-5)
    mean, var = moments_from_totals(local_totals(tf.constant(parts[0]), -1, np.zeros((1, 4), bool)))
    assert mean.numpy().tolist() == [0.0] * 2 and var.numpy().tolist() == [0.0] * 2

def test_process_set_arguments_one_rank(one_rank):
    """process_set=, ignore_name_scope and the set ops on one rank (no mpiexec); sets of
    several ranks are checked under mpiexec (tf_checks.py)."""
    x = tf.constant([1.0, 2.0])
    out = hvd.allreduce(x, process_set=hvd.global_process_set, ignore_name_scope=True)
    assert out.numpy().tolist() == [1.0, 2.0]
    assert int(hvd.size_op()) == 1 and int(hvd.size_op(0)) == 1
    assert int(hvd.process_set_included_op()) == 1
    assert hvd.size_op().dtype == tf.int32 and hvd.process_set_included_op().dtype == tf.int32
    out = hvd.alltoall(tf.constant([5, 6]))               # no splits: the output alone, as Horovod
    assert isinstance(out, tf.Tensor) and out.numpy().tolist() == [5, 6]
    out, received = hvd.alltoall(tf.constant([5, 6]), splits=[2])
    assert out.numpy().tolist() == [5, 6] and received.numpy().tolist() == [2]
    with pytest.raises(ValueError, match="process_set_id=5"):
        hvd.size_op(5)
    with pytest.raises(ValueError, match="process_set_id=5"):
        hvd.process_set_included_op(5)
    with pytest.raises(TypeError, match="process_set_id must be an int"):
        hvd.size_op("0")
    with pytest.raises(ValueError, match="not registered"):
        hvd.allgather(x, process_set=hvd.ProcessSet([0]))
    with pytest.raises(TypeError, match="ProcessSet"):
        hvd.broadcast(x, 0, process_set=1)
    with pytest.raises(ValueError, match="add_process_set"):
        hvd.add_process_set([0])          # not dynamic: says what to set


def test_import_errors_say_what_to_install():
    """Without TensorFlow, or with one older than 2.16, the import says what to do."""
    code = ("import sys, types\n"
            "sys.modules['tensorflow'] = None\n"
            "try:\n    import hvd_magic.tensorflow\nexcept ImportError as e:\n    print('ERR', e)\n"
            "del sys.modules['tensorflow']\n"
            "sys.modules['tensorflow'] = types.SimpleNamespace(__version__='2.15.1')\n"
            "for m in [k for k in sys.modules if k.startswith('hvd_magic.tensorflow')]:\n"
            "    del sys.modules[m]\n"
            "try:\n    import hvd_magic.tensorflow\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 2, out
    assert "pip install" in lines[0] and "tensorflow-cpu" in lines[0]
    assert "2.16" in lines[1] and "2.15.1" in lines[1]


def test_hvd_magic_import_does_not_load_tensorflow():
    code = "import sys, hvd_magic, hvd_magic.collectives; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_under_mpi(np_, tmp_path):
    """Collectives eager and in tf.function, gradients, tape == whole-batch gradients, fit ==
    single-process SGD, callbacks, mismatch errors, checkpoint/load_model (see tf_checks.py)."""
    proc = mpirun("tf_checks.py", np_, str(tmp_path), env=TF_ENV, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_keras_horovod_entry_points_under_mpi(np_):
    """compute_gradients/_compute_gradients + apply_gradients, register_local_var, gradient
    aggregation (counter, iterations, sum/average, eager and tf.function),
    PartialDistributedOptimizer, BroadcastGlobalVariablesCallback(local_variables=...),
    from_config (see tf_keras_horovod.py)."""
    proc = mpirun("tf_keras_horovod.py", np_, env=TF_ENV, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_compat_under_mpi(np_):
    """What Horovod's test_tensorflow.py needs: FailedPreconditionError on a mismatch (eager,
    tf.function, TF1 session), InvalidArgumentError on bad splits, uint16 data movement,
    grouped_allreduce of IndexedSlices, Horovod's reducescatter gradient scale,
    broadcast_global_variables, the session-graph broadcast gradient (tf_horovod_compat.py)."""
    proc = mpirun("tf_horovod_compat.py", np_, env=TF_ENV, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_tensorflow_distributed_optimizer_in_a_session_under_mpi(np_):
    """TF1 graph mode: hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer)
    gives every rank the weights of one process training on the whole batch (minimize,
    compute_gradients + apply_gradients, backward_passes_per_step with a global_step,
    register_local_var; tf_v1_optimizer.py)."""
    proc = mpirun("tf_v1_optimizer.py", np_, env=TF_ENV, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout


@pytest.mark.slow
def test_digits_converges_at_2_ranks():
    proc = mpirun("tf_digits.py", 2, env=TF_ENV, timeout=120)
    acc = [float(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.startswith("accuracy")]
    assert acc and acc[0] > 0.9, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("np_", [2, 3])
def test_legacy_keras_under_mpi(np_):
    """TF_USE_LEGACY_KERAS=1 (tf.keras is tf_keras, Keras 2): model.fit with DistributedOptimizer
    and the callbacks == single-process SGD, same weights on every rank; legacy optimizers,
    gradient aggregation, DistributedGradientTape with opt.variables() (tf_legacy_keras.py)."""
    pytest.importorskip("tf_keras")
    proc = mpirun("tf_legacy_keras.py", np_, env=TF_ENV, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout
