"""Grouped allgather / reducescatter, the torch face's sparse_allreduce_async and the TF
names that came with them (broadcast_, broadcast_object_fn, the *_op rank/size tensors):
Horovod's names and signatures (without process_set), one-rank behaviour and argument
errors here; the multi-rank checks under real mpiexec at 2 and 3 ranks
(tests/mpi/grouped_checks.py; the TensorFlow ones are in tests/mpi/tf_checks.py)."""
import inspect

import numpy as np
import pytest
import torch

import hvd_magic.collectives as C
import hvd_magic.torch as hvd
from mpi_harness import mpirun


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


E = inspect.Parameter.empty


def test_torch_signatures_match_horovod():
    PS = ("process_set", hvd.global_process_set)
    assert params(hvd.grouped_allgather) == [("tensors", E), ("name", None), PS]
    assert params(hvd.grouped_allgather_async) == [("tensors", E), ("name", None), PS]
    assert params(hvd.grouped_reducescatter) == [
        ("tensors", E), ("name", None), ("compression", hvd.Compression.none), ("op", hvd.Average),
        PS, ("prescale_factor", 1.0), ("postscale_factor", 1.0)]
    assert params(hvd.grouped_reducescatter_async) == [
        ("tensors", E), ("name", None), ("op", hvd.Average), PS, ("prescale_factor", 1.0),
        ("postscale_factor", 1.0)]
    assert params(hvd.sparse_allreduce_async) == [("tensor", E), ("name", E), ("op", E), PS]


def test_collectives_signatures():
    PS = ("process_set", C.global_process_set)
    assert params(C.grouped_allgather) == [("tensors", E), ("name", None), PS]
    assert params(C.grouped_reducescatter_async) == [
        ("tensors", E), ("name", None), ("op", C.Average), ("prescale_factor", 1.0),
        ("postscale_factor", 1.0), PS]


def test_single_rank_collectives(one_rank):
    a = [np.arange(3), np.ones((2, 2), np.float32), np.array(5.0), torch.ones(2, 1)]
    out = C.grouped_allgather(a)
    assert [type(o) for o in out] == [np.ndarray, np.ndarray, np.ndarray, torch.Tensor]
    assert out[2].tolist() == [5.0] and out[1].dtype == np.float32
    out = C.synchronize(C.grouped_reducescatter_async([np.arange(3.0), torch.ones(2)], op=C.Sum,
                                                      prescale_factor=2.0))
    assert out[0].tolist() == [0.0, 2.0, 4.0] and out[1].tolist() == [2.0, 2.0]


def test_argument_errors(one_rank):
    for fn in (C.grouped_allgather, C.grouped_allgather_async, C.grouped_reducescatter,
               C.grouped_reducescatter_async, hvd.grouped_allgather, hvd.grouped_reducescatter,
               hvd.grouped_allgather_async, hvd.grouped_reducescatter_async):
        with pytest.raises(ValueError, match="empty"):
            fn([])
        with pytest.raises(TypeError, match="list"):
            fn(np.ones(2))
    with pytest.raises(ValueError, match="tensor 1 is 0-d"):
        C.grouped_reducescatter([np.ones(2), np.array(1.0)])
    with pytest.raises(TypeError, match="torch tensor"):
        hvd.grouped_allgather([torch.ones(1), np.ones(1)])
    assert C.pending() == []     # nothing went out for a bad list


def test_single_rank_torch(one_rank):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (y,) = hvd.grouped_allgather([x])
    (y * torch.tensor([3.0, 4.0])).sum().backward()
    assert x.grad.tolist() == [3.0, 4.0]
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (y,) = hvd.grouped_reducescatter([x], op=hvd.Average, postscale_factor=2.0)
    y.sum().backward()
    assert y.tolist() == [2.0, 4.0] and x.grad.tolist() == [2.0, 2.0]
    sp = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,),
                                 check_invariants=False)
    h = hvd.sparse_allreduce_async(sp, "sp", hvd.Sum)
    out = hvd.synchronize(h)
    assert out.is_sparse and out._nnz() == 2 and out.to_dense().tolist() == [3.0, 0.0, 0.0]
    assert h().to_dense().tolist() == [3.0, 0.0, 0.0] and hvd.poll(h)
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2), "d", hvd.Sum)
    with pytest.raises(ValueError, match="Average or hvd.Sum"):
        hvd.sparse_allreduce_async(sp, "m", hvd.Min)


def test_tensorflow_names_and_signatures(one_rank):
    tf = pytest.importorskip("tensorflow")
    import hvd_magic.tensorflow as htf
    from hvd_magic.tensorflow.compression import Compression
    ps = htf.global_process_set
    assert params(htf.grouped_allgather) == [("tensors", E), ("name", None), ("ignore_name_scope", False),
                                             ("process_set", ps)]
    assert params(htf.grouped_reducescatter) == [
        ("tensors", E), ("device_dense", ""), ("compression", Compression.none), ("op", htf.Average),
        ("process_set", ps), ("prescale_factor", 1.0), ("postscale_factor", 1.0), ("name", None)]
    assert params(htf.broadcast_) == [("variables", E), ("root_rank", E), ("name", None), ("process_set", ps)]
    assert params(htf.broadcast_object_fn) == [("root_rank", 0), ("session", None), ("name", None),
                                               ("process_set", ps)]
    assert params(htf.size_op) == [("process_set_id", 0), ("name", None)]
    assert params(htf.process_set_included_op) == [("process_set_id", 0), ("name", None)]
    ops = ["size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op"]
    for n in ops[1:4]:
        assert params(getattr(htf, n)) == [("name", None)]
    assert [int(getattr(htf, n)()) for n in ops] == [1, 1, 0, 0, 1]
    assert htf.size_op().dtype == tf.int32 and htf.rank_op().shape == ()
    with pytest.raises(ValueError, match="process_set_id"):
        htf.size_op(process_set_id=1)      # no such set registered
    v = tf.Variable([1.0, 2.0])
    assert [t.numpy().tolist() for t in htf.broadcast_([v], root_rank=0)] == [[1.0, 2.0]]
    assert htf.broadcast_object_fn()({"a": 1}) == {"a": 1}
    assert htf.grouped_reducescatter([]) == []        # as Horovod
    with pytest.raises(ValueError, match="empty"):
        htf.grouped_allgather([])
    with pytest.raises(TypeError, match="variables"):
        htf.broadcast_([tf.ones(2)], root_rank=0)


@pytest.mark.parametrize("np_", [2, 3])
def test_grouped_under_mpi(np_):
    """Values against references and the single ops, torch gradients, sparse Sum/Average,
    mismatch errors naming the member tensor (see tests/mpi/grouped_checks.py)."""
    proc = mpirun("grouped_checks.py", np_, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout + proc.stderr
