"""hvd_magic.ray's RayExecutor, and ``%%hvd -np 2 --ray ADDRESS`` (the notebook pool with
its ranks in Ray actors), on one real two-node Ray cluster.

The cluster is made as on two machines: a head node (``ray start --head``) in one network
namespace and a worker node (``ray start --address``) in another, joined by a veth pair
(tests/netns_hosts.py). One cluster serves every test of the module; it is stopped by
killing the processes in its two namespaces (``ray stop`` would end every Ray process on
the machine, other runs' included). The drivers run in the head's namespace, as a user's
script would on the head node, and print one ``RESULT <json>`` line for the test to read;
the pool's kernel side runs there too, through a real IPython shell (tests/mpi/ray_pool.py),
as a notebook on the head node would.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

import netns_hosts
import ray_cluster

ray = pytest.importorskip("ray", reason="Ray is not installed (make setup installs it)")

from hvd_magic.ray import RayExecutor  # noqa: E402

SUBNET = "10.239.0.0/24"
PORT = 6390
POOL_DRIVER = os.path.join(os.path.dirname(__file__), "mpi", "ray_pool.py")


@pytest.fixture(scope="module")
def cluster():
    why = netns_hosts.unusable_reason()
    if why:
        pytest.skip(why)
    with ray_cluster.two_nodes(SUBNET, "ray", PORT) as running:
        yield running


def drive(cluster, script: str, *args: str, timeout: float = 300) -> dict:
    """Run driver ``script`` on the head node; its RESULT line as a dict."""
    hosts, address, env = cluster
    path = os.path.join(hosts.shared, "driver.py")
    with open(path, "w") as fh:
        fh.write(script)
    return ray_cluster.result(hosts.run([sys.executable, path, address, hosts.shared, *args],
                                        env=env, timeout=timeout, host=hosts.a))


def ray_workers(cluster) -> list:
    """The executor's worker processes still running on either node."""
    hosts = cluster[0]
    pids = [p for ps in hosts.pids().values() for p in ps]
    return [d for d in netns_hosts.describe_pids(pids) if "BaseHorovodWorker" in d]


TRAIN = r'''
import importlib.util, json, os, socket, sys
import ray
import torch

ray.init(address=sys.argv[1], log_to_driver=False)
from hvd_magic.ray import RayExecutor

STEPS, BATCH = 5, 8


def data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(BATCH, 4, generator=g) for _ in range(STEPS)]
    return [(x, x.sum(1, keepdim=True)) for x in xs]


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def train():
    import hvd_magic.torch as hvd
    hvd.init()
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    for x, y in data(hvd.rank()):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "cross_rank": hvd.cross_rank(),
            "weights": [p.detach().flatten().tolist() for p in m.parameters()]}


def reference(size):
    """One process on the whole batch (both ranks' shards each step)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for shards in zip(*(data(r) for r in range(size))):
        x = torch.cat([s[0] for s in shards]); y = torch.cat([s[1] for s in shards])
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in m.parameters()]


def where():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")
    return dict({k: os.environ.get(k) for k in keys}, hostname=socket.gethostname(),
                ip=ray.util.get_node_ip_address())


class Counter:
    def __init__(self, start):
        self.n = start

    def bump(self):
        self.n += 1
        return self.n


out = {"nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])}
settings = RayExecutor.create_settings(timeout_s=120, nics={"hvd0"})
ex = RayExecutor(settings, num_workers=2, num_hosts=2)
ex.start(executable_cls=Counter, executable_args=[10])
out["where"] = ex.run(where)
out["execute"] = ex.execute(lambda c: c.bump())
out["execute_single"] = ex.execute_single(lambda c: c.bump())
out["run_remote"] = ray.get(ex.run_remote(lambda a, b: a + b, args=[2], kwargs={"b": 3}))
# hvd.init() over torch.distributed: the controller of issue 36 item 1
if importlib.util.find_spec("hvd_magic.collectives.controller") is not None:
    out["trained"] = ex.run(train)
    out["reference"] = reference(2)
pg = ex.placement_group
ex.shutdown()
out["pg_state"] = ray.util.placement_group_table(pg)["state"]
# num_workers alone: one-worker bundles packed onto as few nodes as fit (1 CPU each here)
packed = RayExecutor(settings, num_workers=2)
packed.start()
out["packed"] = packed.run(where)
packed.shutdown()
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def two_node_job(cluster):
    """One driver run of TRAIN on the cluster (its RESULT), shared by the tests below."""
    return drive(cluster, TRAIN)


def test_two_nodes_get_one_worker_each_with_torchruns_variables(cluster, two_node_job):
    hosts, out = cluster[0], two_node_job
    assert out["nodes"] == [hosts.a.ip, hosts.b.ip]
    where = out["where"]
    # one worker per node, ranks 0 and 1, each the only rank of its node
    assert sorted(w["ip"] for w in where) == [hosts.a.ip, hosts.b.ip]
    assert {w["hostname"] for w in where} == {hosts.a.ns, hosts.b.ns}
    assert [w["RANK"] for w in where] == ["0", "1"]
    assert [w["GROUP_RANK"] for w in where] == ["0", "1"]
    assert all(w["WORLD_SIZE"] == "2" and w["LOCAL_RANK"] == "0"
               and w["LOCAL_WORLD_SIZE"] == "1" for w in where)
    # rank 0's node is the rendezvous, the same for both
    assert {w["MASTER_ADDR"] for w in where} == {where[0]["ip"]}
    assert len({w["MASTER_PORT"] for w in where}) == 1
    # executable_cls lives in each worker and keeps its state between calls
    assert out["execute"] == [11, 11]
    assert out["execute_single"] == 12
    assert out["run_remote"] == [5, 5]
    # shutdown removed the placement group and the workers' processes
    assert out["pg_state"] == "REMOVED"
    # num_workers=2 alone on two one-CPU nodes: one bundle per node, ranks node by node
    packed = out["packed"]
    assert sorted(w["ip"] for w in packed) == [hosts.a.ip, hosts.b.ip]
    assert [w["RANK"] for w in packed] == ["0", "1"]
    assert {w["MASTER_ADDR"] for w in packed} == {packed[0]["ip"]}
    assert _gone(cluster)


def test_hvd_trains_across_the_two_nodes_to_equal_weights(two_node_job):
    out = two_node_job
    if "trained" not in out:
        pytest.skip("needs the torch.distributed controller (issue 36 item 1)")
    r0, r1 = out["trained"]
    assert [(r["rank"], r["size"], r["local_rank"], r["cross_rank"]) for r in (r0, r1)] == \
        [(0, 2, 0, 0), (1, 2, 0, 1)]
    assert r0["weights"] == r1["weights"]
    # hvd.DistributedOptimizer's averaged gradients: one process on both shards
    for got, want in zip(r0["weights"], out["reference"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def _gone(cluster, wait: float = 10.0) -> bool:
    """True once no executor worker process runs on either node (within ``wait`` s)."""
    deadline = time.monotonic() + wait
    while ray_workers(cluster):
        if time.monotonic() > deadline:
            raise AssertionError(f"workers left behind: {ray_workers(cluster)}")
        time.sleep(0.2)
    return True


KILL = r'''
import json, os, signal, sys, threading, time
import ray

ray.init(address=sys.argv[1], log_to_driver=False)
from hvd_magic.ray import RayExecutor, RayWorkerError

shared = sys.argv[2]
ex = RayExecutor(RayExecutor.create_settings(timeout_s=120, nics={"hvd0"}), num_workers=2,
                 num_hosts=2)
ex.start()
pids = ex.run(os.getpid)


def loop(shared):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1000)
    open(os.path.join(shared, f"ready-{dist.get_rank()}"), "w").close()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        dist.all_reduce(t)
        t /= 2
    return "the loop ended without an error"


killed = {}


def kill_rank_1():
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(shared, f"ready-{r}")) for r in (0, 1)):
        time.sleep(0.05)
    time.sleep(0.5)
    killed["at"] = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)


threading.Thread(target=kill_rank_1, daemon=True).start()
out = {"pids": pids, "nodes": [n["ip"] for n in ex.nodes]}
pg = ex.placement_group
try:
    out["returned"] = ex.run(loop, args=[shared])
except RayWorkerError as exc:
    out.update(took=time.monotonic() - killed["at"], error=str(exc), rank=exc.rank,
               node=exc.node)
try:
    ex.run(os.getpid)
except RuntimeError as exc:
    out["after"] = str(exc)
out["pg_state"] = ray.util.placement_group_table(pg)["state"]


def fails_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch")
    return "ok"


ex.start()                       # new workers after the failure
try:
    out["returned_2"] = ex.run(fails_on_rank_1)
except RayWorkerError as exc:
    out.update(raised=str(exc), raised_rank=exc.rank, raised_node=exc.node)
print("RESULT " + json.dumps(out), flush=True)
'''


def test_a_killed_worker_ends_run_naming_its_rank_and_node(cluster):
    out = drive(cluster, KILL)
    assert "returned" not in out, out
    assert out["rank"] == 1 and out["node"] == out["nodes"][1]
    assert out["error"].startswith(f"rank 1 (on node {out['nodes'][1]}) died"), out["error"]
    assert out["took"] < 5, out
    # the surviving rank, stuck in its allreduce, was stopped too; nothing is left
    assert out["pg_state"] == "REMOVED"
    assert "call start() again" in out["after"]
    # start() makes new workers; a function that raises on one rank ends run naming it
    assert "returned_2" not in out, out
    assert out["raised_rank"] == 1
    assert out["raised"].startswith("rank 1 (on node ") and \
        "raised ValueError: bad batch" in out["raised"], out["raised"]
    assert "fails_on_rank_1" in out["raised"]          # the rank's traceback
    assert _gone(cluster)


# ------------------------------------------------ %%hvd --ray on the same cluster

@pytest.fixture(scope="module")
def on_cluster(cluster):
    """One driver run of the ``cluster`` scenario (its RESULT), shared by the tests below."""
    hosts, address, env = cluster
    # the nodes' hostnames resolve to 127.0.0.1: gloo must use the veth (as with any
    # cluster whose hostnames do not resolve to the address the others reach)
    proc = hosts.run([sys.executable, POOL_DRIVER, "cluster", address, hosts.a.ns, hosts.b.ns],
                     env=dict(env, GLOO_SOCKET_IFNAME="hvd0"), timeout=480, host=hosts.a)
    return ray_cluster.result(proc), hosts


@pytest.mark.slow
def test_a_ray_pool_spans_both_nodes_and_keeps_state_between_cells(on_cluster):
    res, hosts = on_cluster
    # the start names the cluster's nodes and the rank on each
    line = next(x for x in res["start_text"].splitlines() if x.startswith("hvd: Ray cluster"))
    assert "2 nodes" in line and "2 ranks on 2" in line, res["start_text"]
    on = {r: h.split("(")[1].rstrip(")") for r, h in res["hosts"].items()}
    assert sorted(on.values()) == [hosts.a.ip, hosts.b.ip], res["hosts"]
    for r, ip in on.items():
        assert f"({ip}): rank {r}" in line, line
    assert f"the Ray nodes reach the controller at {hosts.a.ip}" in res["start_text"]
    # an allreduce across the nodes: 1 + 2 on each rank
    assert res["first"] == {"0": [0, 2, [3.0] * 3], "1": [1, 2, [3.0] * 3]}
    # the second cell sees the first one's w: 3 + (3 + 3)
    assert res["second"] == {"0": [0, [9.0] * 3], "1": [1, [9.0] * 3]}
    assert hosts.b.ip in res["status"] and "Ray cluster" in res["status"]
    # past --timeout: interrupted on both nodes (through the engines' nannies); the pool
    # and its state stay
    assert res["timeout"].startswith("PoolCellTimeout") and "the pool is ready" in \
        res["timeout"], res["timeout"]
    assert res["same_pool"] and res["third"] == res["second"]
    assert res["pulled"] == [[7, [9.0] * 3], [14, [9.0] * 3]]
    # the engines' side of the controller: on the head host's address only, no wildcard
    assert res["engine_interface"] == f"tcp://{hosts.a.ip}"
    listen = [tuple(x) for x in res["controller_listen"]]
    assert listen and {ip for ip, _ in listen} <= {hosts.a.ip, "127.0.0.1"}, listen


@pytest.mark.slow
def test_the_live_panel_gets_both_nodes_telemetry(on_cluster):
    """A training-like cell on the Ray pool: what the live panel draws (each rank's samples
    and time in collectives) comes from both ranks; shown here as its text summary."""
    res, _ = on_cluster
    text = res["telemetry"]
    m = re.search(r"hvd: throughput .* samples/s in total.*"
                  r"\(rank 0 ([\d.]+)(?: [kM])?, rank 1 ([\d.]+)(?: [kM])?\)", text)
    assert m and all(float(v) > 0 for v in m.groups()), text
    assert re.search(r"hvd: collectives in flight \S+ of the time \(rank 0 \S+, rank 1 \S+\)",
                     text), text


@pytest.mark.slow
def test_hvd_stacks_on_a_ray_pool_shows_the_rank_on_each_node(on_cluster):
    """%hvd stacks while a cell runs on both nodes: each rank's stack, asked and read on its
    own node by its actor, with the cell's line it runs; the cell goes on."""
    res, _ = on_cluster
    text = res["stacks"]
    assert "hvd: the stacks of 2 rank(s)" in text and "no stack" not in text, text
    for r in (0, 1):
        assert re.search(rf"rank {r}: runs \S+:4 \(in <module>\), not in a collective",
                         text), text
    assert res["stacks_running"] and res["stacks_cell_ok"], res
    assert res["stacks_s"] < 8, res["stacks_s"]


@pytest.mark.slow
def test_stop_leaves_no_engine_or_ray_worker_behind(on_cluster):
    res, _ = on_cluster
    assert res["stopped_clean"] and res["left_after_stop"] == [], res["left_after_stop"]
    assert res["atexit_ran_on"] == ["0", "1"], res["atexit_ran_on"]


@pytest.mark.slow
def test_export_of_a_ray_pool_is_a_ray_driver_that_gives_the_same_results(on_cluster):
    """%hvd export after two cells on the Ray cluster writes a Ray driver (RayExecutor);
    run with python, its two workers print what the cells showed, and nothing is left."""
    res, _ = on_cluster
    assert "python " in res["export_said"] and "hvdrun" not in res["export_said"], \
        res["export_said"]
    code, stdout, stderr = res["exported_run"]
    assert code == 0, stdout + stderr
    printed = stdout.splitlines()
    for r in (0, 1):       # each cell's last value, on each worker, as the pool showed it
        assert f"[{r}] ({r}, 2, [3.0, 3.0, 3.0])" in printed, stdout + stderr
        assert f"[{r}] ({r}, [9.0, 9.0, 9.0])" in printed, stdout + stderr
    assert res["left_after_export"] == [], res["left_after_export"]


@pytest.mark.slow
def test_a_killed_rank_ends_the_cell_naming_it(on_cluster):
    res, hosts = on_cluster
    text = res["killed"]
    assert text.startswith("RankDiedError"), text
    assert "rank 1 died: killed by signal SIGKILL" in text and res["victim_node"] in text, text
    assert "rank 0" not in text.split("\n")[0].split("rank 1")[0], text
    print(f"the cell ended {res['killed_after_s']:.2f} s after the kill")
    assert res["killed_after_s"] < 10, res["killed_after_s"]     # 5 s is the aim
    assert res["after_death_clean"] and res["left_after_death"] == [], res["left_after_death"]


def test_arguments_are_checked_before_anything_starts():
    settings = RayExecutor.create_settings(timeout_s=5)
    assert settings.timeout_s == 5 and settings.placement_group_timeout_s == 100
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="num_workers=3 does not match num_hosts=2"):
        RayExecutor(settings, num_workers=3, num_hosts=2)
    with pytest.raises(ValueError, match="num_workers .*or num_hosts"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="hvdrun --min-np"):
        RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        RayExecutor(settings, num_workers=2).run(os.getpid)


def test_module_paths_are_horovods():
    import hvd_magic.ray
    import hvd_magic.ray.runner
    assert hvd_magic.ray.RayExecutor is hvd_magic.ray.runner.RayExecutor
    # nothing else in hvd_magic imports the launcher
    src = os.path.join(os.path.dirname(hvd_magic.ray.__file__), "..")
    found = subprocess.run(["grep", "-rlE", r"(from|import) (hvd_magic\.ray|\.+ray)\b",
                            "--include=*.py", src], capture_output=True, text=True).stdout
    assert [f for f in found.split() if "/ray/" not in f] == []
