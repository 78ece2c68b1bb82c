"""hvd_magic.torch: the horovod.torch face. Multi-rank checks run under real mpiexec
(tests/mpi/torch_checks.py groups them, one launch per rank count)."""
import inspect
import re

import pytest
import torch

import hvd_magic.torch as hvd
from mpi_harness import mpirun

HOROVOD_NAMES = """init shutdown size rank local_rank local_size cross_rank cross_size is_initialized
mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built
cuda_built rocm_built is_homogeneous start_timeline stop_timeline poll synchronize join barrier
broadcast_object allgather_object allreduce allreduce_ allreduce_async allreduce_async_
grouped_allreduce grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_ allgather
allgather_async broadcast broadcast_ broadcast_async broadcast_async_ alltoall reducescatter
Average Sum Adasum Min Max Product Compression DistributedOptimizer broadcast_parameters
broadcast_optimizer_state SyncBatchNorm HorovodInternalError ProcessSet global_process_set
add_process_set remove_process_set grouped_allgather grouped_allgather_async grouped_reducescatter
grouped_reducescatter_async sparse_allreduce_async alltoall_async reducescatter_async""".split()


def test_public_names():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing


def test_signatures_match_horovod():
    sig = inspect.signature
    ar = sig(hvd.allreduce).parameters
    assert list(ar) == ["tensor", "average", "name", "compression", "op", "prescale_factor",
                        "postscale_factor", "process_set"]
    assert [ar[n].default for n in list(ar)[1:]] == [None, None, hvd.Compression.none, None, 1.0, 1.0,
                                                     hvd.global_process_set]
    assert list(sig(hvd.allreduce_async_).parameters) == ["tensor", "average", "name", "op",
                                                          "prescale_factor", "postscale_factor",
                                                          "process_set"]
    assert list(sig(hvd.broadcast).parameters) == ["tensor", "root_rank", "name", "process_set"]
    assert list(sig(hvd.reducescatter).parameters) == ["tensor", "name", "compression", "op",
                                                       "process_set", "prescale_factor",
                                                       "postscale_factor"]
    assert list(sig(hvd.barrier).parameters) == ["process_set"]
    params = list(sig(hvd.DistributedOptimizer).parameters.values())
    assert [p.name for p in params] == ["optimizer", "named_parameters", "compression",
                                        "backward_passes_per_step", "op",
                                        "gradient_predivide_factor", "num_groups", "groups",
                                        "sparse_as_dense", "process_set"]
    assert [p.default for p in params[1:]] == [None, hvd.Compression.none, 1, hvd.Average, 1.0,
                                               0, None, False, hvd.global_process_set]
    assert list(sig(hvd.broadcast_parameters).parameters) == ["params", "root_rank"]
    assert sig(hvd.broadcast_optimizer_state).parameters["root_rank"].default == 0


def test_compression_dtypes():
    t = torch.randn(4)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float32
    c, ctx = hvd.Compression.bf16.compress(t)
    assert c.dtype == torch.bfloat16
    i = torch.arange(3)
    assert hvd.Compression.fp16.compress(i)[0] is i
    assert hvd.Compression.none.compress(t)[0] is t




def test_single_process(one_rank):
    """One rank (no mpiexec): everything works and reduces to the plain optimizer."""
    assert hvd.size() == 1 and hvd.rank() == 0
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.Adam)
    m(torch.ones(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert m.weight.grad is None
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.1
    bn = hvd.SyncBatchNorm(2)
    ref = torch.nn.BatchNorm1d(2)
    x = torch.randn(5, 2)
    assert torch.allclose(bn(x), ref(x))
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=[("a", m.weight), ("a", m.bias)])
    # Adasum at one rank: the delta optimizer's step is the plain step
    w0 = m.weight.detach().clone()
    ada = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Adasum)
    m.weight.grad = torch.ones_like(m.weight)
    m.bias.grad = torch.zeros_like(m.bias)
    ada.step()
    assert torch.allclose(m.weight.detach(), w0 - 0.1)
    with pytest.raises(ValueError, match="hvd.Average, hvd.Sum or hvd.Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Max)
    with pytest.warns(DeprecationWarning):
        assert torch.equal(hvd.allreduce(torch.ones(2), average=False), torch.ones(2))


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_checks_under_mpi(np_):
    proc = mpirun("torch_checks.py", np_, timeout=120)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout + proc.stderr


@pytest.mark.parametrize("np_", [2, 3])
def test_sparse_gradients_and_fresh_optimizer_state_under_mpi(np_):
    """Sparse embedding gradients stay sparse (allgathered, or densified with
    sparse_as_dense) and match single-process training; broadcast_optimizer_state before
    the first step leaves parameters alone and zero grads (tests/mpi/torch_sparse_checks.py)."""
    proc = mpirun("torch_sparse_checks.py", np_, timeout=120)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout + proc.stderr


def test_digits_script_trains(tmp_path):
    proc = mpirun("torch_digits.py", 2, str(tmp_path), timeout=120)
    acc = float(re.search(r"accuracy ([0-9.]+)", proc.stdout).group(1))
    assert acc > 0.9, proc.stdout
    writers = set(re.findall(r"checkpoint written by rank (\d+)", proc.stdout))
    assert writers == {"0"}, proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
    saved = torch.load(tmp_path / "checkpoint.pt")
    assert saved["epoch"] == 9 and "model" in saved


def test_bucket_partition():
    """Gradient buckets: reverse registration order, per dtype, sizes from HVD_MAGIC_BUCKET_BYTES."""
    from hvd_magic.torch.buckets import bucket_caps, make_buckets
    assert bucket_caps("") == (1 << 20, 4 << 20)
    assert bucket_caps("0") == (0, 0) and bucket_caps("100,0") == (0, 0)
    assert bucket_caps("4096") == (4096, 4096) and bucket_caps("10,20") == (10, 20)
    with pytest.raises(ValueError, match="HVD_MAGIC_BUCKET_BYTES"):
        bucket_caps("lots")
    # 64 Linear layers of width 96 (benchmarks/torch_training.py's mlp): 128 tensors, 2 buckets
    layers = [torch.nn.Linear(3072, 96)] + [torch.nn.Linear(96, 96) for _ in range(62)] + [torch.nn.Linear(96, 10)]
    mlp = torch.nn.Sequential(*layers)
    params = list(mlp.parameters())
    names = {id(p): n for n, p in mlp.named_parameters()}
    bs = make_buckets(params, names, None, bucket_caps(""))
    assert len(bs) == 2
    assert sorted(id(p) for b in bs for p in b.params) == sorted(map(id, params))
    assert bs[0].params[0] is params[-1]                         # last layer first
    assert 1 << 20 <= bs[0].nbytes < (1 << 20) + 40000
    assert bs[0].name.startswith("grad.bucket0[") and bs[0].name.endswith("..63.bias]")
    assert bs[1].name == "grad.bucket1[0.weight.." + bs[1].name.split("..")[1]
    assert bs[0].flat.numel() == sum(p.numel() for p in bs[0].params)
    v = bs[0].views[params[-2]]
    assert v.shape == params[-2].shape and v.data_ptr() >= bs[0].flat.data_ptr()
    # off: one per parameter, named after it
    off = make_buckets(params, names, None, (0, 0))
    assert len(off) == 128 and all(b.flat is None for b in off) and off[0].name == "63.bias"
    # a parameter larger than the cap: alone, no flat buffer
    big = make_buckets(params, names, None, (1000, 1000))
    assert any(len(b.params) == 1 and b.params[0] is params[0] and b.flat is None for b in big)
    # dtypes never share a bucket; groups (int / lists) are buckets
    a, b, c = (torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)),
               torch.nn.Parameter(torch.zeros(3)))
    nm = {id(a): "a", id(b): "b", id(c): "c"}
    mixed = make_buckets([a, b, c], nm, None, bucket_caps(""))
    assert sorted(len(x.params) for x in mixed) == [1, 2]
    grouped = make_buckets([a, b, c], nm, [[a, c]], bucket_caps(""))
    assert [id(x) for x in grouped[0].params] == [id(a), id(c)] and grouped[0].name == "grad.group0[a..c]"
    assert [[id(y) for y in x.params] for x in grouped[1:]] == [[id(b)]]
    assert len(make_buckets(params, names, 4, bucket_caps(""))) == 4
    with pytest.raises(ValueError, match="more than one"):
        make_buckets([a, b, c], nm, [[a], [a, c]], bucket_caps(""))
