"""Adasum (op=hvd.Adasum): the pure math and plan of hvd_magic.collectives.adasum, a
simulation of the plan's exchanges against the reference tree, and the real thing under
mpiexec at 2, 3 and 4 ranks (tests/mpi/coll_adasum.py)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_magic.collectives import adasum as A
from hvd_magic.collectives.fusion import Bucket, plan_fusion
from hvd_magic.collectives.negotiation import Ann, Response
from hvd_magic.collectives.ops import ReduceOp, check_op_dtype
from mpi_harness import mpirun


# ---------------------------------------------------------------- the two-vector formula

def test_orthogonal_vectors_are_summed():
    a, b = np.array([1.0, 0.0, 0.0]), np.array([0.0, 2.0, -3.0])
    assert np.allclose(A.adasum_pair(a, b), a + b)


def test_equal_vectors_give_the_vector_itself():
    a = np.array([3.0, -4.0, 0.5])
    assert np.allclose(A.adasum_pair(a, a), a)


def test_opposite_vectors():
    # a.b = -|a|^2: each coefficient is 1.5, and the two cancel
    a = np.array([1.0, 2.0])
    assert np.allclose(A.adasum_pair(a, -a), 0.0)
    # parallel, different lengths: a = u, b = 2u -> (1 - 2/2) u + (1 - 2/8) 2u = 1.5 u
    assert np.allclose(A.adasum_pair(a, 2 * a), 1.5 * a)


def test_zero_side_is_added_as_it_is():
    a = np.array([1.0, -2.0])
    assert np.array_equal(A.adasum_pair(a, np.zeros(2)), a)
    assert np.array_equal(A.adasum_pair(np.zeros(2), a), a)
    assert np.array_equal(A.adasum_pair(np.zeros(2), np.zeros(2)), np.zeros(2))
    assert A.coefficients(5.0, 0.0, 1e-300) == (1.0, 1.0)


def test_formula_and_symmetry():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(7), rng.standard_normal(7)
    d = a @ b
    expect = (1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b
    assert np.allclose(A.adasum_pair(a, b), expect)
    assert np.allclose(A.adasum_pair(b, a), expect)


def test_dot_norms_accumulate_in_float64_over_chunks():
    a = np.full(3 * A._CHUNK + 5, 0.1, dtype=np.float32)
    b = np.full(a.size, -0.2, dtype=np.float32)
    got = A.dot_norms(a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert got.dtype == np.float64
    assert np.allclose(got, [a64 @ b64, a64 @ a64, b64 @ b64], rtol=1e-12)
    assert np.array_equal(A.dot_norms(np.zeros(0), np.zeros(0)), np.zeros(3))


def test_combine_into_keeps_the_dtype():
    a = np.array([1.0, 2.0], dtype=np.float32)
    b = np.array([3.0, 4.0], dtype=np.float32)
    A.combine_into(a, b, 0.5, 2.0)
    assert a.dtype == np.float32 and np.allclose(a, [6.5, 9.0])


# ---------------------------------------------------------------- reference tree and plan

def test_reference_of_one_and_two_vectors():
    v = np.arange(4.0).reshape(2, 2)
    assert np.array_equal(A.reference_adasum([v]), v)
    w = -v + 1
    assert np.allclose(A.reference_adasum([v, w]), A.adasum_pair(v, w).reshape(2, 2))
    with pytest.raises(ValueError):
        A.reference_adasum([])


def test_reference_tree_order():
    rng = np.random.default_rng(1)
    v = [rng.standard_normal(5) for _ in range(6)]
    P = A.adasum_pair
    # 6 ranks: 4 and 5 fold into 0 and 1, then ((0 1) (2 3))
    expect = P(P(P(v[0], v[4]), P(v[1], v[5])), P(v[2], v[3]))
    assert np.allclose(A.reference_adasum(v), expect)
    # identical vectors on every rank: the vector itself, at any size
    for n in range(1, 8):
        assert np.allclose(A.reference_adasum([v[0]] * n), v[0])


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_largest_power_of_two(size):
    p = A.largest_pow2(size)
    assert p <= size < 2 * p and p & (p - 1) == 0


def test_plan_halves_like_horovod():
    # 4 ranks, 5 elements: level 1 splits [0, 5) at 2, level 2 splits each half again
    keeps = {r: [s.keep for s in A.plan_adasum(r, 4, 5).steps] for r in range(4)}
    assert keeps == {0: [(0, 2), (0, 1)], 1: [(2, 5), (2, 3)],
                     2: [(0, 2), (1, 2)], 3: [(2, 5), (3, 5)]}
    s = A.plan_adasum(2, 4, 5).steps
    assert [(x.level, x.partner, x.high, x.color) for x in s] == [(1, 3, False, 1), (2, 0, True, 0)]


def test_plan_folds_ranks_beyond_the_power_of_two():
    assert A.plan_adasum(0, 3, 4) == A.Plan(2, 2, False, A.plan_adasum(0, 2, 4).steps)
    assert A.plan_adasum(1, 3, 4).fold is None
    assert A.plan_adasum(2, 3, 4) == A.Plan(2, 0, True, ())
    assert A.plan_adasum(6, 7, 4) == A.Plan(4, 2, True, ())
    assert A.plan_adasum(0, 1, 4) == A.Plan(1, None, False, ())
    with pytest.raises(ValueError, match="outside"):
        A.plan_adasum(3, 3, 4)


def test_group_colors():
    assert A.group_colors(0, 1) == []
    assert A.group_colors(1, 2) == [0]
    assert [A.group_colors(r, 4) for r in range(4)] == [[0, 0], [0, 0], [1, 0], [1, 0]]
    assert A.group_colors(4, 6) == [None, None]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 16, 33])
def test_simulated_exchanges_match_the_reference(size, n):
    """Run the plans of all ranks in lock step on plain arrays (what adasum_allreduce does
    with Sendrecv and the group Allreduce) and compare with reference_adasum."""
    rng = np.random.default_rng(size * 100 + n)
    vecs = [rng.standard_normal(n) for _ in range(size)]
    plans = [A.plan_adasum(r, size, n) for r in range(size)]
    bufs = [v.copy() for v in vecs]
    for r, pl in enumerate(plans):                        # fold
        if pl.fold is not None and not pl.folded:
            bufs[r] = A.adasum_pair(bufs[r], bufs[pl.fold])
    active = [r for r, pl in enumerate(plans) if not pl.folded]
    for k in range(len(plans[0].steps)):
        steps = {r: plans[r].steps[k] for r in active}
        got = {r: bufs[steps[r].partner][slice(*steps[r].keep)].copy() for r in active}
        dots = {}
        for r in active:
            s = steps[r]
            d = A.dot_norms(bufs[r][slice(*s.keep)], got[r])
            if s.high:
                d[[1, 2]] = d[[2, 1]]
            dots[r] = d
        sums = {}
        for r in active:                                   # the group's Allreduce
            sums[r] = sum(dots[q] for q in active if steps[q].color == steps[r].color)
            assert sum(1 for q in active if steps[q].color == steps[r].color) == 2 * steps[r].level
        for r in active:
            s = steps[r]
            dot, left, right = sums[r]
            c = A.coefficients(dot, right, left) if s.high else A.coefficients(dot, left, right)
            A.combine_into(bufs[r][slice(*s.keep)], got[r], *c)
    owned = {r: (plans[r].steps[-1].keep if plans[r].steps else (0, n)) for r in active}
    for k in reversed(range(len(plans[0].steps))):        # gather back
        new = {r: bufs[r].copy() for r in active}
        for r in active:
            s = plans[r].steps[k]
            new[r][slice(*s.send)] = bufs[s.partner][slice(*s.send)]
        bufs = [new.get(r, b) for r, b in enumerate(bufs)]
    for r, pl in enumerate(plans):
        if pl.folded:
            bufs[r] = bufs[pl.fold].copy()
    ref = A.reference_adasum(vecs)
    for r in range(size):
        assert np.allclose(bufs[r], ref, rtol=1e-10, atol=1e-12), (r, owned)
    # every element is computed by exactly one rank
    cover = np.zeros(n, int)
    for lo, hi in owned.values():
        cover[lo:hi] += 1
    assert (cover == 1).all()


# ---------------------------------------------------------------- checks and fusion

def test_adasum_takes_floats_only():
    for dt in ("float16", "bfloat16", "float32", "float64"):
        check_op_dtype(ReduceOp.ADASUM, dt)
    for dt in ("int8", "uint8", "int32", "int64", "bool"):
        with pytest.raises(ValueError, match=f"Adasum.*{dt}"):
            check_op_dtype(ReduceOp.ADASUM, dt)


def _ready(name, op, shape=(4,)):
    ann = Ann(name, "allreduce", "float32", shape, int(op), -1, 1.0, 1.0, "cpu")
    return Response(name, "allreduce", {0: ann, 1: ann})


def test_fusion_gives_each_adasum_its_own_bucket():
    rs = [_ready("a", ReduceOp.AVERAGE), _ready("x", ReduceOp.ADASUM), _ready("b", ReduceOp.AVERAGE),
          _ready("y", ReduceOp.ADASUM), _ready("z", ReduceOp.ADASUM)]
    plan = plan_fusion(rs, threshold=1 << 20)
    assert all(isinstance(p, Bucket) for p in plan)
    assert [p.names for p in plan] == [["a", "b"], ["x"], ["y"], ["z"]]


def test_driver_refuses_what_it_cannot_reduce():
    class One:
        def Get_size(self):
            return 1
    with pytest.raises(TypeError, match="float32/float64"):
        A.adasum_allreduce(One(), np.zeros(3, dtype=np.int32))
    with pytest.raises(TypeError, match="float32/float64"):
        A.adasum_allreduce(One(), np.zeros((2, 2)))
    buf = np.ones(3)
    assert A.adasum_allreduce(One(), buf) is buf


# ---------------------------------------------------------------- under MPI

@pytest.mark.parametrize("np_", [2, 3, 4], ids=["np2", "np3", "np4"])
def test_adasum_under_mpi(np_):
    """numpy float16/32/64 and torch tensors (bfloat16 too), sizes from 0 to above the
    fusion threshold's pieces, odd lengths and fewer elements than ranks, in and out of
    place, scaled, async, a joined rank; identical bytes on every rank; int -> ValueError;
    DistributedOptimizer(op=Adasum) (one step against the reference, and training); the
    ValueError through torch.distributed."""
    proc = mpirun("coll_adasum.py", np_, timeout=300)
    assert proc.stdout.count("coll_adasum OK") == np_, proc.stdout + proc.stderr


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_tensorflow_gradient_tape_adasum_under_mpi(np_):
    """DistributedGradientTape(op=Adasum), eager and in tf.function, per gradient against the
    reference; IndexedSlices need sparse_as_dense; Keras' optimizer refuses Adasum."""
    pytest.importorskip("tensorflow")
    proc = mpirun("coll_adasum.py", np_, "tf", timeout=300)
    assert proc.stdout.count("coll_adasum OK") == np_, proc.stdout + proc.stderr


def test_reducescatter_refuses_adasum_as_horovod_does():
    import numpy as np
    import hvd_magic.collectives as C
    for call in (lambda: C.reducescatter(np.ones(4), op=C.Adasum),
                 lambda: C.grouped_reducescatter([np.ones(4)], op=C.Adasum)):
        with pytest.raises(ValueError, match="does not take op=hvd.Adasum") as info:
            call()
        assert isinstance(info.value, RuntimeError)      # what Horovod's tests expect
