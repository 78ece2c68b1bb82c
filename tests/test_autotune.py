"""Autotune: the search itself (pure, no MPI), then for real under mpiexec at 2 and 3 ranks."""
import dataclasses

import pytest

from mpi_harness import mpirun

from hvd_magic.collectives.autotune import CONFIRM, CYCLE_MS, FUSION_MB, SAMPLES, Setting, Tuner


def run_search(tuner, best_at, steps=10_000):
    """Feed a tuner one tensor per step; a step takes 1 ms, less the nearer the setting is to
    ``best_at`` in each knob."""
    t, tried = 0.0, [tuner.current]
    for _ in range(steps):
        s = tuner.current
        t += 0.001 - 0.0002 * (s.fusion_mb == best_at.fusion_mb) - 0.0003 * (s.cycle_ms == best_at.cycle_ms)
        nxt = tuner.observe([("g", 1000)], t)
        if nxt is not None:
            tried.append(nxt)
            tuner.applied(t)
        if not tuner.active:
            return tried
    raise AssertionError("the search did not end")


def test_coordinate_search_tries_cycle_times_then_thresholds_and_settles_on_the_fastest():
    rows = []
    start = Setting(64.0, 0.0)
    tuner = Tuner(start, warmups=1, steps_per_sample=2, log=rows.append)
    best_at = Setting(8.0, 2.5)
    tried = run_search(tuner, best_at)
    # the start, the other cycle times at 64 MiB, then the other thresholds at the best cycle
    cycles = [Setting(64.0, c) for c in CYCLE_MS if c != 0.0]
    assert tried[:1 + len(cycles)] == [start] + cycles
    assert tuner.current == best_at and tried[-1] == best_at and not tuner.active
    assert len(rows) == tuner.n_trials + 1            # one row per trial, then the chosen one
    assert tuner.n_trials == len(tuner.scores) + CONFIRM   # the best ones measured again
    assert rows[-1].startswith("0,0,0,1,2.5,8,")
    assert max(tuner.scores, key=tuner.scores.get) == best_at


def test_warmup_trials_are_discarded_and_fixed_knobs_are_not_tried():
    tuner = Tuner(Setting(64.0, 0.0), tune_cycle=False, warmups=2, steps_per_sample=1)
    tried = run_search(tuner, Setting(2.0, 0.0))
    assert {s.cycle_ms for s in tried} == {0.0}
    assert sorted({s.fusion_mb for s in tried}) == sorted(FUSION_MB)
    assert Tuner(Setting(1.0, 1.0), tune_cycle=False, tune_fusion=False).active is False


def test_a_sample_ends_when_a_tensor_comes_round_steps_per_sample_more_times():
    tuner = Tuner(Setting(64.0, 0.0), warmups=0, steps_per_sample=3)
    for i in range(3 * SAMPLES):              # exactly SAMPLES samples' worth: not over yet
        assert tuner.observe([("a", 10), ("b", 10)], i * 0.001) is None
    assert tuner.samples and len(tuner.samples) == SAMPLES - 1


def test_with_both_knobs_set_every_rank_says_there_is_nothing_to_tune():
    from hvd_magic.collectives.autotune import for_engine
    from hvd_magic.collectives.config import Config
    cfg = dataclasses.replace(Config.from_env(), autotune=True, autotune_fixed=("fusion", "cycle"))
    for rank in (0, 1):
        tuner, status = for_engine(cfg, rank, 0)
        assert tuner is None and status["active"] is False


def test_max_trials_caps_the_search():
    tuner = Tuner(Setting(64.0, 0.0), warmups=0, steps_per_sample=1, max_trials=3)
    run_search(tuner, Setting(64.0, 1.0))
    assert tuner.n_trials == 3


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_autotune_settles_on_every_rank_and_logs_horovods_columns(np_, tmp_path):
    log = tmp_path / "autotune.csv"
    proc = mpirun("autotune.py", np_, str(log), timeout=150,
                  env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                       "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
                       "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2"})
    assert proc.stdout.count("autotune OK") == np_, proc.stdout + proc.stderr
