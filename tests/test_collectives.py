"""The collective runtime for real, under mpiexec at 2 and 3 ranks (an odd ring catches
off-by-one errors). Each test launches one worker script from tests/mpi/ that runs many
checks sharing one start-up and exits nonzero listing every failed check per rank."""
from __future__ import annotations

import re

import pytest

from mpi_harness import mpirun

NP = pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])


@NP
def test_every_op_dtype_shape_and_tensor_type(np_):
    """allreduce (every op, prescale/postscale, in place, async, grouped), allgather, broadcast
    (each root), alltoall (with and without splits), reducescatter, barrier, object ops; numpy
    and torch; MPI-fused, unfused, in 1 KiB MPI pieces and torch.distributed/gloo (the path CUDA
    tensors take with NCCL) paths. Values against numpy references."""
    proc = mpirun("coll_ops.py", np_, timeout=300)
    assert proc.stdout.count("coll_ops OK") == np_, proc.stdout


@NP
def test_orders_fusion_timeline_join_subcomm_reinit(np_, tmp_path):
    proc = mpirun("coll_misc.py", np_, str(tmp_path), timeout=180)
    assert proc.stdout.count("coll_misc OK") == np_, proc.stdout
    for name in ("fusion.json", "nofusion.json", "env_timeline.json"):
        assert (tmp_path / name).exists(), name


@NP
def test_mismatch_errors_on_every_rank(np_):
    proc = mpirun("coll_errors.py", np_, timeout=120)
    assert proc.stdout.count("coll_errors OK") == np_, proc.stdout


@NP
def test_stall_warning_and_stall_shutdown(np_):
    proc = mpirun("coll_stall.py", np_, timeout=120)
    assert proc.stdout.count("coll_stall OK") == np_, proc.stdout
    # rank 0 warned about 'slow', naming the rank that had not submitted it
    warn = re.search(r"\[hvd_magic rank 0\] WARNING: stall.*\n\s+allreduce of tensor 'slow' has waited "
                     r"[\d.]+ s: submitted by rank\(s\) [\d, ]+, not yet by rank\(s\) 1\n", proc.stderr)
    assert warn, proc.stderr
    # and about 'never', naming the last rank
    assert "tensor 'never'" in proc.stderr and f"not yet by rank(s) {np_ - 1}" in proc.stderr, proc.stderr


def test_engine_thread_only_path_at_3_ranks(tmp_path):
    """With HVD_MAGIC_INLINE=0 a waiting caller never runs the negotiation cycle itself: the
    background thread does all of it (the path async requests take); with
    HOROVOD_CACHE_CAPACITY=0 every announcement
    travels in full and no cycle is reused. Orders, fusion, join and every mismatch error
    still hold."""
    env = {"HVD_MAGIC_INLINE": "0", "HOROVOD_CACHE_CAPACITY": "0"}
    proc = mpirun("coll_misc.py", 3, str(tmp_path), env=env, timeout=180)
    assert proc.stdout.count("coll_misc OK") == 3, proc.stdout
    proc = mpirun("coll_errors.py", 3, env=env, timeout=120)
    assert proc.stdout.count("coll_errors OK") == 3, proc.stdout


def test_ctrl_c_during_an_inline_cycle_is_held_until_the_cycle_ends():
    """A waiting main thread runs negotiation cycles itself; a Ctrl-C in the middle of one
    must not leave it half done. It is held back and raised as soon as the cycle ends."""
    import signal

    from hvd_magic.collectives import interrupts

    old = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        held = interrupts.defer_sigint()
        assert held is signal.default_int_handler
        signal.raise_signal(signal.SIGINT)            # no KeyboardInterrupt here
        assert signal.getsignal(signal.SIGINT) is interrupts.hold
        with pytest.raises(KeyboardInterrupt):
            interrupts.restore_sigint(held)               # raised now
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        interrupts.restore_sigint(interrupts.defer_sigint())  # none came in: nothing raised
        assert not interrupts.HELD
    finally:
        signal.signal(signal.SIGINT, old)


@NP
def test_the_response_cache_announces_a_loop_by_bits_and_keeps_every_check(np_):
    """A loop's steady state needs no full messages; orders, mismatches, the stall check,
    join, shutdown, process sets and a full cache behave as without the cache."""
    proc = mpirun("coll_cache.py", np_, timeout=180)
    assert proc.stdout.count("done, 0 failures") == np_, proc.stdout + proc.stderr
    assert re.search(r"\[hvd_magic rank 0\] WARNING: stall.*\n\s+allreduce of tensor 'slowc' has "
                     rf"waited [\d.]+ s: submitted by rank\(s\) [\d, ]+, not yet by rank\(s\) "
                     rf"{np_ - 1}\n", proc.stderr), proc.stderr
