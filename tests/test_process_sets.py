"""Process sets, for real under mpiexec at 2 and 3 ranks (tests/mpi/process_sets.py): sets
registered at init and at run time, two disjoint sets reducing at once, a set a rank is not
in, global root ranks, unnamed calls per set, errors naming the set, removal, init again."""
import pytest

from mpi_harness import mpirun

from hvd_magic.collectives import ProcessSet


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_process_sets(np_):
    proc = mpirun("process_sets.py", np_, timeout=180)
    assert proc.stdout.count("process_sets OK") == np_, proc.stdout + proc.stderr


def test_process_set_arguments_are_checked_before_anything_is_sent():
    assert ProcessSet([2, 0]).ranks == [0, 2]
    assert ProcessSet(range(3)).ranks == [0, 1, 2]
    # any iterable of ranks, sorted, as Horovod's
    assert ProcessSet(reversed(range(1, 4))).ranks == [1, 2, 3]
    assert ProcessSet(k for k in (2, 0)).ranks == [0, 2]
    assert ProcessSet({3: "a", 1: "b"}).ranks == [1, 3]
    for bad, fragment in (([0, 0], "appears twice"), (["a"], "int ranks"), ("01", "int ranks"),
                          ([True], "int ranks"), (iter([1, 1]), "appears twice"),
                          (5, "not int")):
        with pytest.raises(ValueError, match=fragment):
            ProcessSet(bad)
    assert ProcessSet([1]).size() is None and ProcessSet([1]).rank() is None
