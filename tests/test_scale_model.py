"""The coordination model of benchmarks/scale.py: bytes per cycle from the protocol."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "scale_bench", Path(__file__).resolve().parent.parent / "benchmarks" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def test_vector_is_one_word_and_one_per_64_slots():
    assert scale.vector_bytes(0) == 8
    assert scale.vector_bytes(50) == 16
    assert scale.vector_bytes(64) == 16
    assert scale.vector_bytes(65) == 24


def test_before_every_rank_sends_a_slot_to_every_other():
    for n in (2, 16, 1024):
        assert scale.cycle_cost(n, "before")["sent"] == (n - 1) * 2048


def test_now_grows_with_log2_ranks_and_a_miss_costs_both():
    link = dict(bw=25e9 / 8, lat=5e-6)
    for n, steps in ((2, 1), (16, 4), (1024, 10)):
        now = scale.cycle_cost(n, "now", "recursive_doubling", slots=50, **link)
        assert now["sent"] == steps * 16
        assert now["time_s"] == pytest.approx(steps * (5e-6 + 16 / (25e9 / 8)))
        miss = scale.cycle_cost(n, "miss", "recursive_doubling", slots=50, **link)
        before = scale.cycle_cost(n, "before", **link)
        assert miss["time_s"] == pytest.approx(now["time_s"] + before["time_s"])
    # binomial (Open MPI's default for this small vector here): the mean over ranks stays
    # under two vectors however many ranks
    assert scale.cycle_cost(1024, "now", "binomial")["sent"] < 2 * 16
    with pytest.raises(ValueError, match="unknown algorithm"):
        scale.cycle_cost(4, "now", "tree")
