"""Pure unit tests of the collectives' planning: the replicated negotiation table
(hvd_magic.collectives.negotiation), the announcement codec and cycle cache (.codec) and the
fusion planner (.fusion). No MPI, no threads."""
from __future__ import annotations

import pytest

from hvd_magic.collectives.codec import AnnCodec, CycleCache
from hvd_magic.collectives.fusion import Bucket, nbytes, plan_fusion
from hvd_magic.collectives.negotiation import Ann, Negotiator, RankMsg, Response, check_agreement
from hvd_magic.collectives.ops import ReduceOp


def ar(name, shape=(4,), dtype="float32", op=ReduceOp.AVERAGE, pre=1.0, post=1.0, device="cpu"):
    return Ann(name, "allreduce", dtype, tuple(shape), int(op), -1, pre, post, device)


def msg(*anns, **kw):
    return RankMsg(anns=tuple(anns), **kw)


def idle():
    return RankMsg()


def names(responses):
    return [r.name for r in responses]


# ---------------------------------------------------------------- negotiation

def test_lockstep_all_ready_in_one_cycle():
    neg = Negotiator(3)
    out = neg.step([msg(ar("a"), ar("b")) for _ in range(3)])
    assert names(out) == ["a", "b"]
    assert all(r.error is None for r in out)
    assert set(out[0].anns) == {0, 1, 2}
    assert not neg.busy


@pytest.mark.parametrize("size", [2, 3])
def test_different_submission_orders_across_cycles(size):
    """Rank 0 submits a,b,c; rank 1 c,b,a; rank 2 b,a,c - one tensor per cycle each.
    Every tensor is decided exactly once, the moment its last rank submits it."""
    orders = [["a", "b", "c"], ["c", "b", "a"], ["b", "a", "c"]][:size]
    neg = Negotiator(size)
    decided = []
    for cycle in range(3):
        out = neg.step([msg(ar(orders[r][cycle])) for r in range(size)], now=float(cycle))
        assert all(r.error is None for r in out), out
        decided += names(out)
        for resp in out:
            assert set(resp.anns) == set(range(size))
    assert sorted(decided) == ["a", "b", "c"]
    assert not neg.pending and not neg.busy
    # Same inputs -> same decisions on a second replica (what keeps ranks in agreement).
    neg2 = Negotiator(size)
    again = []
    for cycle in range(3):
        again += names(neg2.step([msg(ar(orders[r][cycle])) for r in range(size)], now=float(cycle)))
    assert again == decided


def test_waits_for_missing_rank_and_busy():
    neg = Negotiator(2)
    assert neg.step([msg(ar("x")), idle()], now=1.0) == []
    assert neg.busy
    st = neg.stalled(now=5.0, older_than=2.0)
    assert len(st) == 1 and st[0].name == "x" and st[0].ready_ranks == [0] and st[0].missing_ranks == [1]
    assert "x" in st[0].describe(5.0) and "rank(s) 1" in st[0].describe(5.0)
    assert neg.stalled(now=2.0, older_than=2.0) == []      # not old enough yet
    out = neg.step([idle(), msg(ar("x"))], now=6.0)
    assert names(out) == ["x"] and out[0].error is None
    assert not neg.busy


def _mismatch(size, make, kind="allreduce"):
    neg = Negotiator(size)
    out = neg.step([msg(make(r)) for r in range(size)])
    assert len(out) == 1
    r = out[0]
    assert r.error is not None and r.error_kind == "mismatch", r
    assert kind in r.error and "'t'" in r.error
    return r.error


def test_mismatch_shape_names_ranks_and_values():
    err = _mismatch(3, lambda r: ar("t", shape=(3,) if r == 1 else (2,)))
    assert "shape" in err and "rank 1 sent (3,)" in err and "ranks 0, 2 sent (2,)" in err


def test_mismatch_dtype():
    err = _mismatch(2, lambda r: ar("t", dtype="float32" if r == 0 else "float64"))
    assert "dtype" in err and "rank 0 sent 'float32'" in err and "rank 1 sent 'float64'" in err


def test_mismatch_op():
    err = _mismatch(2, lambda r: ar("t", op=ReduceOp.SUM if r else ReduceOp.AVERAGE))
    assert "op" in err and "Sum" in err and "Average" in err


@pytest.mark.parametrize("field", ["pre", "post"])
def test_mismatch_scale(field):
    err = _mismatch(2, lambda r: ar("t", **{field: 1.0 + r}))
    assert f"{field}scale_factor" in err and "rank 1 sent 2.0" in err


def test_mismatch_root_rank():
    err = _mismatch(2, lambda r: Ann("t", "broadcast", "float32", (2,), root=r), "broadcast")
    assert "root_rank" in err and "rank 0 sent 0" in err and "rank 1 sent 1" in err


def test_mismatch_allgather_trailing_dims_but_first_dim_may_differ():
    neg = Negotiator(2)
    ok = neg.step([msg(Ann("g", "allgather", "float32", (r + 1, 3))) for r in range(2)])
    assert ok[0].error is None
    err = _mismatch(2, lambda r: Ann("t", "allgather", "float32", (2, 3 + r)), "allgather")
    assert "all but the first dimension" in err and "(3,)" in err and "(4,)" in err


def test_mismatch_different_op_kinds():
    err = Negotiator(2).step([msg(ar("t")), msg(Ann("t", "allgather", "float32", (4,)))])[0].error
    assert "different operations" in err and "'allreduce'" in err and "'allgather'" in err and "'t'" in err


def test_mismatch_on_general_path_too():
    """The same check applies when the tensor is decided across cycles (not lockstep)."""
    neg = Negotiator(2)
    assert neg.step([msg(ar("t", shape=(2,))), idle()]) == []
    out = neg.step([idle(), msg(ar("t", shape=(5,)))])
    assert out[0].error_kind == "mismatch" and "rank 1 sent (5,)" in out[0].error


def test_check_agreement_ok():
    assert check_agreement("allreduce", "t", {0: ar("t"), 1: ar("t")}) is None


def test_joined_rank_allreduce_completes_without_it():
    neg = Negotiator(3)
    assert neg.step([msg(ar("x")), RankMsg(join=True), idle()]) == []
    out = neg.step([idle(), idle(), msg(ar("x"))])
    assert names(out) == ["x"] and out[0].error is None
    assert out[0].joined == frozenset({1})
    assert set(out[0].anns) == {0, 2}
    # Everyone joins: one join response with the last rank to join.
    out = neg.step([RankMsg(join=True), idle(), idle()])
    assert out == []
    out = neg.step([idle(), idle(), RankMsg(join=True)])
    assert [(r.kind, r.last_joined) for r in out] == [("join", 2)]
    assert not neg.busy


def test_joined_rank_broadcast_is_an_error():
    neg = Negotiator(2)
    out = neg.step([msg(Ann("b", "broadcast", "float32", (2,), root=0)), RankMsg(join=True)])
    assert out[0].error_kind == "joined" and "'b'" in out[0].error and "1" in out[0].error


def test_cancel_fails_pending_request():
    neg = Negotiator(3)
    neg.step([msg(ar("x")), msg(ar("x")), idle()])
    out = neg.step([RankMsg(cancels=(("x", "gave up on x"),)), idle(), idle()])
    assert len(out) == 1 and out[0].error_kind == "stall" and out[0].error == "gave up on x"
    assert set(out[0].anns) == {0, 1}
    assert not neg.pending
    # A second cancel of the same name (another rank gave up too) is a no-op.
    assert neg.step([idle(), RankMsg(cancels=(("x", "again"),)), idle()]) == []


def test_shutdown_fails_requests_the_shut_rank_never_submitted():
    neg = Negotiator(2)
    neg.step([msg(ar("x")), idle()])
    out = neg.step([idle(), RankMsg(shutdown=True)])
    assert out[0].name == "x" and out[0].error_kind == "shutdown" and "rank(s) 1" in out[0].error
    out = neg.step([RankMsg(shutdown=True), idle()])
    assert [r.kind for r in out] == ["shutdown"]
    assert not neg.busy


def test_shutdown_all_at_once():
    out = Negotiator(3).step([RankMsg(shutdown=True)] * 3)
    assert [r.kind for r in out] == ["shutdown"]


def test_duplicate_submission_is_reported():
    neg = Negotiator(2)
    neg.step([msg(ar("x")), idle()])
    out = neg.step([msg(ar("x")), idle()])
    assert out[0].error_kind == "mismatch" and "twice" in out[0].error


def test_wrong_message_count():
    with pytest.raises(ValueError):
        Negotiator(2).step([idle()])
    with pytest.raises(ValueError):
        Negotiator(0)


# ---------------------------------------------------------------- fusion

def ready(ann, joined=frozenset()):
    return Response(ann.name, ann.kind, {0: ann, 1: ann}, joined=joined)


def test_fusion_groups_by_key_and_threshold():
    f32 = [ready(ar(f"f{i}", shape=(256,))) for i in range(5)]    # 1 KiB each
    f64 = [ready(ar(f"d{i}", shape=(128,), dtype="float64")) for i in range(2)]
    summ = ready(ar("s", shape=(256,), op=ReduceOp.SUM))
    plan = plan_fusion([f32[0], f64[0], f32[1], summ, f32[2], f64[1], f32[3], f32[4]], threshold=3 * 1024)
    buckets = [p for p in plan if isinstance(p, Bucket)]
    assert [b.names for b in buckets] == [["f0", "f1", "f2"], ["d0", "d1"], ["s"], ["f3", "f4"]]
    # Buckets keep their dtype/op key.
    assert buckets[0].key[0] == "float32" and buckets[1].key[0] == "float64"


def test_fusion_threshold_zero_disables():
    rs = [ready(ar(f"t{i}", shape=(4,))) for i in range(4)]
    plan = plan_fusion(rs, threshold=0)
    assert [p.names for p in plan] == [["t0"], ["t1"], ["t2"], ["t3"]]


def test_fusion_big_tensor_gets_own_bucket():
    rs = [ready(ar("small", shape=(4,))), ready(ar("big", shape=(1000,))), ready(ar("small2", shape=(4,)))]
    plan = plan_fusion(rs, threshold=100)
    assert [p.names for p in plan] == [["small"], ["big"], ["small2"]]


def test_fusion_leaves_tensors_of_a_chunk_or_more_alone_on_cpu():
    # 'big' (4000 B) reaches alone=4000: its own bucket, and small ones around it still fuse
    rs = [ready(ar("s1", shape=(4,))), ready(ar("big", shape=(1000,))), ready(ar("s2", shape=(4,))),
          ready(ar("gpu", shape=(1000,), device="cuda:0")), ready(ar("s3", shape=(4,)))]
    plan = plan_fusion(rs, threshold=1 << 20, alone=4000)
    assert [p.names for p in plan] == [["s1", "s2", "s3"], ["big"], ["gpu"]]
    # a tensor just under the size fuses; alone=0 changes nothing
    rs2 = [ready(ar("a", shape=(999,))), ready(ar("b", shape=(999,)))]
    assert [p.names for p in plan_fusion(rs2, threshold=1 << 20, alone=4000)] == [["a", "b"]]
    assert [p.names for p in plan_fusion(rs, threshold=1 << 20)] == [["s1", "big", "s2", "s3"], ["gpu"]]


def test_fusion_separates_scale_and_joined_and_passes_others_through():
    a = ready(ar("a"))
    b = ready(ar("b", pre=2.0))
    c = ready(ar("c"), joined=frozenset({1}))
    d = ready(ar("d"))
    g = ready(Ann("g", "allgather", "float32", (2,)))
    bad = Response("m", "allreduce", {0: ar("m")}, error="boom", error_kind="mismatch")
    plan = plan_fusion([a, g, b, c, bad, d], threshold=1 << 20)
    assert [p.names if isinstance(p, Bucket) else p.name for p in plan] == \
        [["a", "d"], "g", ["b"], ["c"], "m"]


def test_half_types_count_float32_bytes():
    assert nbytes(ar("h", shape=(10,), dtype="float16")) == 40
    assert nbytes(ar("h", shape=(10,), dtype="bfloat16")) == 40
    assert nbytes(ar("h", shape=(), dtype="float64")) == 8
    assert nbytes(ar("h", shape=(0, 3), dtype="int8")) == 0


def test_only_a_rank_that_waits_for_others_keeps_negotiating():
    from hvd_magic.collectives.negotiation import Ann, Negotiator, RankMsg
    neg = Negotiator(2)
    a = Ann("g", "allreduce", "float32", (2,))
    neg.step([RankMsg(anns=(a,)), RankMsg()])
    # rank 0 submitted g and waits for rank 1; rank 1 owes g and may sleep until it submits
    assert neg.waiting(0) and not neg.waiting(1)
    out = neg.step([RankMsg(), RankMsg(anns=(a,))])
    assert [r.name for r in out] == ["g"] and not neg.waiting(0) and not neg.waiting(1)


def test_chunk_spans_cover_the_buffer_in_bounded_pieces():
    from hvd_magic.collectives.backends.common import chunk_spans
    assert chunk_spans(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(10, 4, 0) == [(0, 10)]           # 0: one call
    assert chunk_spans(0, 4, 16) == [(0, 0)]            # empty tensors still make their call
    assert chunk_spans(3, 8, 5) == [(0, 3)]             # a chunk smaller than one element: one call
    for n, item, chunk in [(1 << 20, 4, 1 << 20), ((1 << 18) + 3, 8, 1 << 20), (999, 2, 98)]:
        spans = chunk_spans(n, item, chunk)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(0 < (hi - lo) * item <= chunk for lo, hi in spans)


# ---------------------------------------------------------------- compact announcements

def test_codec_sends_repeated_announcements_as_indices_and_every_rank_decodes_them():
    ranks = [AnnCodec(2) for _ in range(2)]          # each rank's codec
    a, b = ar("a"), ar("b", shape=(3, 2))
    wire0 = ranks[0].encode([a, b])                  # rank 0, first cycle: in full
    assert wire0 == (tuple(a), tuple(b))
    for codec in ranks:                              # every rank decodes every rank's message
        assert codec.decode(0, wire0) == (a, b)
    wire1 = ranks[0].encode([ar("b", shape=(3, 2)), ar("a"), ar("c")])   # equal, new objects
    assert wire1 == (1, 0, tuple(ar("c")))
    for codec in ranks:
        assert codec.decode(0, wire1) == (b, a, ar("c"))
    assert ranks[0].tables[0] == ranks[1].tables[0] == [a, b, ar("c")]
    assert ranks[1].tables[1] == []                  # rank 1 announced nothing yet
    # the same name with another shape is another announcement
    assert ranks[0].encode([ar("a", shape=(5,))]) == (tuple(ar("a", shape=(5,))),)


def exchange(codecs, anns_per_rank):
    """One cycle: every rank encodes its announcements, every rank decodes every message;
    each decoding must give back exactly what was announced. Returns the wire items."""
    wires = [c.encode(anns) for c, anns in zip(codecs, anns_per_rank)]
    for c in codecs:
        for r, w in enumerate(wires):
            assert c.decode(r, w) == tuple(anns_per_rank[r])
    return wires


def test_codec_starts_a_full_table_again():
    ranks = [AnnCodec(2, rank=r, cap=3) for r in range(2)]
    a, b = ar("a"), ar("b")
    assert exchange(ranks, [[a, b], []])[0] == (tuple(a), tuple(b))
    assert exchange(ranks, [[b, a], []])[0] == (1, 0)
    assert all(c.tables[0] == [a, b] and c.resets == 0 for c in ranks)
    # per-step names fill rank 0's table (cap 3): after that message it starts again,
    # on every rank, and rank 0's encoder with it
    s1, s2, s3 = ar("step.1"), ar("step.2"), ar("step.3")
    assert exchange(ranks, [[s1, a], [b]])[0] == (tuple(s1), 0)
    assert all(c.tables[0] == [] and c.resets == 1 for c in ranks)
    assert ranks[0].mine == {} and ranks[1].tables[1] == [b]
    assert exchange(ranks, [[a, s2, s3, b], [b]])[0] == (tuple(a), tuple(s2), tuple(s3), tuple(b))
    assert all(c.resets == 2 and c.tables[0] == [] for c in ranks)   # 4 in one message: full again
    assert exchange(ranks, [[a], [b]]) == [(tuple(a),), (0,)]
    assert exchange(ranks, [[a], [b]]) == [(0,), (0,)]


def test_codec_sends_unnamed_calls_as_an_index_and_a_step():
    """Unnamed calls (kind.noname.N, a new N every call) enter the tables without their
    number; later ones travel as (index, step from the last N, suffix), so a loop of
    unnamed calls sends the same bytes every step and every rank decodes the full names."""
    ranks = [AnnCodec(2, rank=r, cap=8) for r in range(2)]
    n7, n8, n9 = ar("allreduce.noname.7"), ar("allreduce.noname.8"), ar("allreduce.noname.9")
    assert exchange(ranks, [[n7], [n7]]) == [(tuple(n7),), (tuple(n7),)]
    assert all(c.tables[r] == [ar("allreduce.noname")] for c in ranks for r in range(2))
    assert exchange(ranks, [[n8], [n8]]) == [((0, 1, ""),), ((0, 1, ""),)]
    assert exchange(ranks, [[n9], [n9]]) == [((0, 1, ""),), ((0, 1, ""),)]   # same bytes again
    assert all(c.last[r] == {"allreduce.noname": 9} for c in ranks for r in range(2))
    # another shape is another entry; suffixes (the optimizer's allreduce.noname.G.P) ride along
    big = ar("allreduce.noname.10", shape=(9,))
    p3, p1 = ar("allreduce.noname.0.3"), ar("allreduce.noname.0.1")
    wires = exchange(ranks, [[big, p3, p1], [big, p3, p1]])
    assert wires[0] == (tuple(big), (0, -10, ".3"), (0, 0, ".1"))
    assert exchange(ranks, [[p3, p1], [p3, p1]])[0] == ((0, 0, ".3"), (0, 0, ".1"))
    # a name that only looks unnamed (no number) is an ordinary name
    odd = ar("x.noname.abc")
    assert exchange(ranks, [[odd], []])[0] == (tuple(odd),)
    assert exchange(ranks, [[odd], []])[0] == (2,)


def test_codec_replays_a_kept_cycle_only_while_the_ranks_numbers_agree():
    """A cycle served from the cache is not decoded: ``replay`` moves every rank's numbers as
    decoding did. When the ranks' numbers no longer stand as they did (a rank skipped a
    number), the same bytes would pair calls of different names: it refuses."""
    ranks = [AnnCodec(2, rank=r, cap=8) for r in range(2)]
    exchange(ranks, [[ar("allreduce.noname.1")], [ar("allreduce.noname.1")]])
    for c in ranks:
        c.begin()
    exchange(ranks, [[ar("allreduce.noname.2")], [ar("allreduce.noname.2")]])
    kept = ranks[0].moves()
    assert kept == {(0, "allreduce.noname"): (1, 2), (1, "allreduce.noname"): (1, 2)}
    # step 3 comes from the cache: nobody decodes, replay moves both ranks to 3
    for c in ranks:
        c.encode([ar("allreduce.noname.3")])
        assert c.replay(kept)
        assert c.last[0] == c.last[1] == {"allreduce.noname": 3}
    # both encoders and decoders agree afterwards: the next step decodes to .4
    assert exchange(ranks, [[ar("allreduce.noname.4")], [ar("allreduce.noname.4")]])[0] == ((0, 1, ""),)
    # rank 1 skipped a number: the same step bytes now mean .5 on rank 0, .6 on rank 1
    ranks[0].last[1]["allreduce.noname"] = 5
    assert not ranks[0].replay(kept) and ranks[0].last[0] == {"allreduce.noname": 4}


# ---------------------------------------------------------------- recurring cycles

def test_cycle_cache_keeps_only_clean_cycles_and_answers_only_when_nothing_is_pending():
    cache = CycleCache(cap=2)
    ok = [ready(ar("a"))]
    # messages as they travel: announcements as table indices (ints) or in full (tuples)
    assert CycleCache.cacheable(RankMsg(anns=(0,))) and CycleCache.cacheable(RankMsg(anns=(3, 1)))
    assert not CycleCache.cacheable(RankMsg(anns=(0, tuple(ar("a")))))   # a full entry
    assert not CycleCache.cacheable(RankMsg(anns=(tuple(ar("a")),)))
    assert not CycleCache.cacheable(idle())                                  # nothing said
    for extra in (dict(join=True), dict(shutdown=True), dict(cancels=(("a", "x"),)),
                  dict(events=(("e",),))):
        assert not CycleCache.cacheable(RankMsg(anns=(0,), **extra))
    cache.put(("k1",), ok, None)
    kept = cache.get(("k1",), busy=False)
    assert (kept.responses, kept.plan, kept.moved, kept.where) == (ok, None, None, None)
    assert cache.hits == 1
    assert cache.get(("k1",), busy=True) is None          # something pending: decide afresh
    assert cache.get(None, busy=False) is None
    bad = [Response("m", "allreduce", {0: ar("m")}, error="boom", error_kind="mismatch")]
    cache.put(("k2",), bad, None)
    assert cache.get(("k2",), busy=False) is None          # errors are not kept
    cache.put(("k3",), ok, None)
    cache.put(("k4",), ok, None)                           # cap 2: k1 goes
    assert cache.get(("k1",), busy=False) is None and cache.get(("k4",), busy=False) is not None
    off = CycleCache(cap=0)
    off.put(("k",), ok, None)
    assert off.get(("k",), busy=False) is None


def test_allreduce_ann_is_the_namedtuple_it_stands_for():
    from hvd_magic.collectives.negotiation import allreduce_ann
    fast = allreduce_ann("g", "float32", (3, 4), int(ReduceOp.SUM), 0.5, 2.0, "cpu")
    slow = Ann("g", "allreduce", "float32", (3, 4), int(ReduceOp.SUM), -1, 0.5, 2.0, "cpu")
    assert fast == slow and type(fast) is Ann and fast._asdict() == slow._asdict()



def test_handle_resolved_once_through_its_resolver():
    """A handle waits through its resolver's ``wait_for`` and takes the first ``resolve``;
    handles.py knows nothing of the engine."""
    import ast
    import inspect

    from hvd_magic.collectives import handles
    from hvd_magic.collectives.handles import Handle

    mods = {n.module for n in ast.walk(ast.parse(inspect.getsource(handles)))
            if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.endswith("engine") for m in mods)

    class Resolver:
        calls = 0

        def wait_for(self, handle, timeout):
            Resolver.calls += 1
            handle.resolve(41)
            handle.resolve(0, RuntimeError("late"))   # ignored: the first call wins

    h = Handle("x", "allreduce", Resolver(), post=lambda r, extra: r + 1)
    assert not h.done() and not h.block(0.0)
    assert h.wait() == 42 and h.done() and h.block(0.0) and Resolver.calls == 1
    assert h.wait() == 42 and Resolver.calls == 1     # done: the resolver is not asked again
    bad = Handle("y", "barrier", Resolver())
    bad.resolve(error=ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        bad.wait()


def test_the_engine_cycles_at_once_on_news_backs_off_while_polling_and_idles_to_the_heartbeat():
    from hvd_magic.collectives.waiting import MAX_POLL_S, MIN_SLEEP_S, next_cycle_in
    assert next_cycle_in(True, False, 7, 0.0, None) == 0.0            # something to send
    assert next_cycle_in(False, True, 0, 0.0, 1.0) == 0.0             # the last cycle brought news
    assert next_cycle_in(False, True, 1, 0.0, 1.0) == 2 * MIN_SLEEP_S  # then backs off ...
    assert next_cycle_in(False, True, 30, 0.0, 1.0) == MAX_POLL_S     # ... up to a bound
    assert next_cycle_in(False, True, 30, 2 * MAX_POLL_S, 1.0) == 0.0
    assert next_cycle_in(False, False, 3, 0.25, 1.0) == 0.75          # idle: the heartbeat
    assert next_cycle_in(False, False, 3, 0.25, None) is None         # no stall check: sleep


# ---------------------------------------------------------------- response cache
def test_response_cache_slots_are_the_same_on_every_rank_and_reused_lowest_first():
    from hvd_magic.collectives.response_cache import ResponseCache
    caches = [ResponseCache(cap=8) for _ in range(3)]      # three ranks, the same decisions
    decided = [Response(n, "allreduce", dict.fromkeys(range(3), ar(n))) for n in "abc"]
    for c in caches:
        assert c.add(decided)
    assert all(c.by_name == {"a": 0, "b": 1, "c": 2} for c in caches)
    c = caches[0]
    assert c.slot(ar("b")) == 1 and c.slot(ar("b", shape=(5,))) is None
    c.drop(1)
    c.add([Response("d", "allreduce", dict.fromkeys(range(3), ar("d")))])
    assert c.by_name == {"a": 0, "d": 1, "c": 2}
    # the same decision again (a cycle cache hit) changes nothing
    v = c.version
    c.add([Response("d", "allreduce", dict.fromkeys(range(3), ar("d")))])
    assert c.version == v
    # the same name decided with other metadata replaces it
    c.add([Response("d", "allreduce", dict.fromkeys(range(3), ar("d", shape=(9,))))])
    assert c.slot(ar("d")) is None and c.slot(ar("d", shape=(9,))) == 1


def test_unnamed_calls_are_kept_without_their_number():
    from hvd_magic.collectives.response_cache import ResponseCache
    c = ResponseCache(cap=8)
    c.add([Response("allreduce.noname.4", "allreduce", {0: ar("allreduce.noname.4")}),
           Response("allreduce.noname.5.1", "allreduce", {0: ar("allreduce.noname.5.1")})])
    assert c.slot(ar("allreduce.noname.9")) == 0            # the next unnamed call alike
    assert c.slot(ar("allreduce.noname.9", shape=(7,))) is None
    assert c.slot(ar("allreduce.noname.12.1")) == 1          # a grouped call's part
    # other shapes of unnamed calls are kept beside each other, not instead
    c.add([Response("allreduce.noname.6", "allreduce", {0: ar("allreduce.noname.6", shape=(7,))})])
    assert c.slot(ar("allreduce.noname.10")) == 0 and c.slot(ar("allreduce.noname.10", shape=(7,))) == 2
    # the key the API makes once per decided call (the short path's look-up) is the same
    a = ar("allreduce.noname.11")
    assert c.key(a) == ("allreduce.noname\0",) + a[1:] and c.by_ann[c.key(a)] == 0


def test_response_cache_keeps_only_what_every_rank_must_agree_on():
    from hvd_magic.collectives.response_cache import ResponseCache
    keeps = ResponseCache.keeps
    every = dict.fromkeys(range(2), ar("x"))
    assert keeps(Response("x", "allreduce", every))
    assert keeps(Response("b", "broadcast", every)) and keeps(Response("r", "reducescatter", every))
    assert not keeps(Response("g", "allgather", every))        # other ranks' rows may change
    assert keeps(Response("allreduce.noname.3", "allreduce", every))
    assert not keeps(Response("x", "allreduce", every, error="mismatch"))
    assert not keeps(Response("x", "allreduce", {0: ar("x")}, joined=frozenset({1})))


def test_response_cache_vector_and_ready_requests():
    """Each rank's vector: word 0 says it has nothing else to say, then one bit per slot;
    after the AND the requests every rank submitted are ready, in slot order."""
    from hvd_magic.collectives.response_cache import ResponseCache
    c = ResponseCache(cap=200)
    c.add([Response(f"t{i}", "allreduce", {0: ar(f"t{i}"), 1: ar(f"t{i}")}) for i in range(70)])
    assert c.words() == 3                     # 70 slots: two words of bits, plus word 0
    v0 = c.vector(True, {0: None, 3: None, 69: None})
    v1 = c.vector(True, [3, 69, 5])
    both = v0 & v1
    assert c.quiet(both) and [s for s, _ in c.ready(both)] == [3, 69]
    assert [r.name for _, r in c.ready(both)] == ["t3", "t69"]
    assert not c.quiet(v0 & c.vector(False, []))        # one rank has more to say
    assert c.words() == ResponseCache(cap=200).words() + 2     # (no rank count anywhere)


def test_a_full_response_cache_starts_again():
    from hvd_magic.collectives.response_cache import ResponseCache
    c = ResponseCache(cap=2)
    assert c.add([Response(n, "allreduce", {0: ar(n)}) for n in "ab"])
    assert not c.add([Response("c", "allreduce", {0: ar("c")})])
    assert c.by_name == {"c": 0}
