"""The pool's one liveness decision (hvd_magic.kernel.notebook.liveness), event sequence by event
sequence, with no process: what a user is told when ranks die, pause or survive. The real
pools behind these rules are tested in test_pool.py, test_failures.py and test_elastic.py."""
from hvd_magic.kernel.notebook import liveness
from hvd_magic.kernel.notebook.liveness import GO_ON, OK, SETTLE, STOP, WAIT, Seen, judge
from hvd_magic.kernel.notebook.output import RankDiedError, RankFailure
from hvd_magic.kernel.notebook.procs import RankExit, parse_rank_exits

KILLED = ("prterun noticed that process rank 1 with PID 4242 on node hostA exited on signal 9 "
          "(Killed).")


def seen(**kw):
    base = dict(size=3, heartbeat_s=3.0, engines=[0, 1, 2], targets=[0, 1, 2])
    base.update(kw)
    return Seen(**base)


def died(r):
    return RankFailure(r, "died", "EngineError", "rank ended")


def test_all_quiet_means_keep_waiting_and_a_clean_end_is_ok():
    assert judge(seen()).action == WAIT
    assert judge(seen(cell=[])).action == OK
    err = RankFailure(1, "error", "ValueError", "bad batch")
    assert judge(seen(cell=[err])).action == OK     # an exception is the cell's, not liveness's


def test_a_killed_rank_of_a_fixed_pool_stops_it_naming_the_rank_and_the_signal():
    # the cell runs; rank 1's task ends with EngineError: let mpiexec say how (grace)
    v = judge(seen(engines_lost=[1]))
    assert (v.action, v.grace) == (SETTLE, liveness.REPORT_GRACE_S)
    # mpiexec reported the kill and exited
    exits = parse_rank_exits(KILLED)
    v = judge(seen(cell=[died(1)], exits=exits, job_ended="mpiexec exited with code 137"))
    assert v.action == STOP and v.lost == (1,)
    err = RankDiedError(list(v.failures), v.text)
    assert str(err) == ("rank 1 died: killed by signal 9 (Killed) on hostA (the MPI job ended, "
                        "so the pool was stopped; the next %%hvd cell starts a new one)")
    assert v.ended == "rank 1 killed by signal 9 (Killed) on hostA"


def test_mpiexec_gone_ends_the_wait_at_once_and_names_how_it_ended():
    v = judge(seen(job_ended="mpiexec killed by SIGKILL"))
    assert (v.action, v.grace) == (SETTLE, liveness.RESULTS_GRACE_S)
    v = judge(seen(cell=[], job_ended="mpiexec killed by SIGKILL"))
    assert v.action == STOP and v.ended == "mpiexec killed by SIGKILL"
    assert v.failures[0].rank == 0 and "the MPI job ended" in v.text


def test_a_paused_rank_ends_the_cell_naming_it_where_it_runs_and_what_to_do():
    paused = dict(unheard=[2], where={2: "pid 77 on hostB"})
    assert judge(seen(**paused)).action == SETTLE            # stop waiting now, no grace
    assert judge(seen(**paused)).grace == 0
    v = judge(seen(cell=[], **paused))
    assert v.action == STOP and v.lost == (2,)
    assert v.failures[0].evalue.startswith("rank 2 (pid 77 on hostB) stopped answering the "
                                           "heartbeat for 3 s: paused")
    assert "resume a paused one within 3 s" in v.ended
    assert "MPI job ended" not in v.text


def test_a_paused_rank_of_an_elastic_pool_is_not_survived():
    # an elastic pool survives dead ranks, not paused ones: its process still exists
    v = judge(seen(elastic=True, min_np=1, unheard=[2], unheard_exited=False))
    assert v.action == SETTLE
    assert judge(seen(elastic=True, min_np=1, unheard=[2], cell=[])).action == STOP


def test_an_elastic_pool_waits_through_a_death_then_goes_on_renumbered():
    # the heartbeat drops rank 1 and its process is gone: the survivors go on training
    assert judge(seen(elastic=True, unheard=[1], unheard_exited=True)).action == WAIT
    exits = parse_rank_exits(KILLED)
    v = judge(seen(elastic=True, unheard=[1], unheard_exited=True, exits=exits,
                   cell=[died(1)]))
    assert v.action == GO_ON and v.lost == (1,)
    assert v.text == ("hvd: rank 1 killed by signal 9 (Killed) on hostA; the pool goes on "
                      "with 2 ranks, renumbered 0..1")


def test_after_a_renumbering_the_lost_rank_is_named_by_its_engine_s_exit():
    # ranks 0, 1 are engines 0, 2 (engine 1 was lost before); engine 2 (rank 1) dies now
    exits = [RankExit(1, "killed by signal 9 (Killed) on a"), RankExit(2, "exited with code 3")]
    v = judge(seen(size=2, engines=[0, 2], targets=[0, 1], elastic=True, exits=exits,
                   cell=[died(1)]))
    assert v.action == GO_ON and v.how == {1: "exited with code 3"}


def test_two_losses_in_one_cell_one_of_them_rank_0():
    v = judge(seen(size=4, engines=[0, 1, 2, 3], elastic=True, min_np=2,
                   cell=[died(0), died(2)]))
    assert v.action == GO_ON and v.lost == (0, 2)
    assert v.text.endswith("the pool goes on with 2 ranks, renumbered 0..1")


def test_fewer_survivors_than_min_np_stop_the_pool():
    v = judge(seen(elastic=True, min_np=2, cell=[died(1), died(2)]))
    assert v.action == STOP and set(v.lost) == {1, 2}


def test_a_death_beside_an_exception_is_not_survived():
    # Horovod's elastic run survives lost ranks; a cell where another rank raised is an error
    err = RankFailure(0, "error", "ValueError", "bad batch")
    v = judge(seen(elastic=True, cell=[died(1), err]))
    assert v.action == STOP and v.lost == (1,)


def test_a_job_that_ended_is_not_elastic_any_more():
    v = judge(seen(elastic=True, job_ended="mpiexec exited with code 1", cell=[died(1)]))
    assert v.action == STOP


def test_a_rank_whose_training_raised_left_and_the_elastic_pool_goes_on_naming_it():
    left = RankFailure(1, "died", liveness.LEFT, "failed (ValueError: bad batch) and left the job")
    exits = [RankExit(1, "exited without MPI_Finalize (os._exit or a crash) on a")]
    v = judge(seen(elastic=True, exits=exits, cell=[left]))
    assert v.action == GO_ON and v.lost == (1,)
    assert v.text == ("hvd: rank 1 failed (ValueError: bad batch) and left the job; the pool "
                      "goes on with 2 ranks, renumbered 0..1")
