"""``%%hvd -np N --ray [ADDRESS]``: the notebook pool with its ranks in Ray actors.

On a real two-node Ray cluster (tests/ray_cluster.py: a head node and a worker node in two
network namespaces) the kernel side runs on the head's host, as a notebook on the head
node would, through a real IPython shell (tests/mpi/ray_pool.py); and once on a Ray the
pool starts for itself on this machine.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import netns_hosts
import ray_cluster

pytest.importorskip("ray", reason="Ray is not installed (make setup installs it)")

HERE = Path(__file__).parent
DRIVER = str(HERE / "mpi" / "ray_pool.py")
SUBNET = "10.238.0.0/24"
PORT = 6391


@pytest.fixture(scope="module")
def cluster():
    why = netns_hosts.unusable_reason()
    if why:
        pytest.skip(why)
    with ray_cluster.two_nodes(SUBNET, "rpl", PORT) as running:
        yield running


def _result(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"driver exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
        f"stderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def on_cluster(cluster):
    """One driver run of the ``cluster`` scenario (its RESULT), shared by the tests below."""
    hosts, address, env = cluster
    # the nodes' hostnames resolve to 127.0.0.1: gloo must use the veth (as with any
    # cluster whose hostnames do not resolve to the address the others reach)
    proc = hosts.run([sys.executable, DRIVER, "cluster", address, hosts.a.ns, hosts.b.ns],
                     env=dict(env, GLOO_SOCKET_IFNAME="hvd0"), timeout=480, host=hosts.a)
    return _result(proc), hosts


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


@pytest.mark.slow
@pytest.mark.parametrize("netns", ["1", "0"])
def test_a_local_ray_pool_started_and_stopped_with_the_pool(netns):
    """``HVD_MAGIC_NETNS=1``: the Ray runs in a loopback-only namespace where one can be
    made; ``0``: this kernel drives it (as where none can be made), and the start says
    that it listens on this machine's addresses."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HVD_MAGIC_NETNS=netns,
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, DRIVER, "local"], env=env, capture_output=True,
                          text=True, timeout=300)
    res = _result(proc)
    assert "local Ray, 1 node" in res["start_text"], res["start_text"]
    assert res["first"] == {"0": [0, 2, [3.0] * 3], "1": [1, 2, [3.0] * 3]}
    assert res["second"] == {"0": [0, [4.0] * 3], "1": [1, [4.0] * 3]}
    # the controller opens no TCP port (Unix sockets); Ray and the ranks run in a
    # loopback-only network namespace where one can be made (their ports open there)
    assert not [x for x in res["listen"] if "kernel.controller" in x[2]], res["listen"]
    if res["netns"]:
        assert res["listen"] == [], res["listen"]
    else:
        assert netns == "0" or netns_hosts.unusable_reason()
        assert "listens on this machine's addresses" in res["start_text"], res["start_text"]
    assert res["killed"].startswith("RankDiedError") and \
        "rank 1 died: killed by signal SIGKILL" in res["killed"], res["killed"]
    # the Ray processes the pool started are gone after %hvd stop
    assert res["stopped_clean"] and res["left"] == [], res["left"]


@pytest.mark.parametrize("line, address", [("-np 2 --ray", "local"),
                                           ("--ray 10.0.0.1:6379 -np 2", "10.0.0.1:6379"),
                                           ("-np 2 --ray auto", "auto"), ("-np 2", None)])
def test_the_ray_option_takes_an_optional_address(line, address):
    from hvd_magic.magics.args import CELL_USAGE, parse_cell_args
    assert parse_cell_args(line).ray == address
    assert "--ray [ADDRESS]" in CELL_USAGE


def test_ray_goes_without_host_lists():
    from hvd_magic.magics.args import HvdUsageError, parse_cell_args
    with pytest.raises(HvdUsageError, match="not allowed with argument"):
        parse_cell_args("-np 2 --ray -H a:1")


def test_a_ray_profile_gives_the_address(tmp_path):
    from hvd_magic.runner.profiles import ProfileError, describe, launch_of, parse_profile
    prof = parse_profile('scheduler = "ray"\nray_address = "10.0.0.1:6379"\nnp = 4\n')
    assert launch_of(prof).ray == "10.0.0.1:6379" and launch_of(prof).np == 4
    assert launch_of(prof, 2).np == 2 and launch_of(prof).hosts is None
    local = parse_profile('scheduler = "ray"\nnp = 2\n')
    assert launch_of(local).ray == "local"
    assert launch_of(parse_profile('scheduler = "hosts"\nhosts = ["a"]\n')).ray is None
    with pytest.raises(ProfileError, match="ray_address: goes with scheduler"):
        parse_profile('scheduler = "hosts"\nhosts = ["a"]\nray_address = "x:1"\n')
    with pytest.raises(ProfileError, match="hosts: Ray places the ranks"):
        parse_profile('scheduler = "ray"\nhosts = ["a"]\n')
    path = tmp_path / "r.toml"
    path.write_text('scheduler = "ray"\nray_address = "auto"\nnp = 2\n')
    assert "ray auto" in describe([("r", str(path))], str(tmp_path))


def test_hvdrun_refuses_a_ray_profile(tmp_path):
    (tmp_path / "r.toml").write_text('scheduler = "ray"\nnp = 2\n')
    env = dict(os.environ, HVD_MAGIC_PROFILE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "--profile", "r",
                           "python", "-c", "1"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "%%hvd --profile" in proc.stderr, proc.stderr
