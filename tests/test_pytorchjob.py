"""docs/examples/pytorchjob.yaml, the MPI-free Kubernetes path of docs/clusters.md: the
manifest is well-formed, and its command line, run once per pod on this machine with the
variables the training operator sets, trains docs/examples/train.py on every rank."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MANIFEST = os.path.join(ROOT, "docs", "examples", "pytorchjob.yaml")
TRAIN = os.path.join(ROOT, "docs", "examples", "train.py")
DOC = os.path.join(ROOT, "docs", "clusters.md")
VENV_BIN = os.path.dirname(sys.executable)


def load():
    with open(MANIFEST) as fh:
        docs = list(yaml.safe_load_all(fh))
    assert len(docs) == 1
    return docs[0]


def pod_commands(job):
    """(replica type, replicas, container) for Master and Worker."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    out = []
    for kind in ("Master", "Worker"):
        containers = specs[kind]["template"]["spec"]["containers"]
        assert [c["name"] for c in containers] == ["pytorch"]   # the name the operator uses
        out.append((kind, specs[kind]["replicas"], containers[0]))
    return out


def flag(command, name):
    found = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    assert len(found) == 1, (name, command)
    return found[0]


def test_manifest_is_a_pytorchjob_whose_pods_run_one_torchrun_line():
    job = load()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    (_, masters, master), (_, workers, worker) = pod_commands(job)
    assert masters == 1 and workers >= 1
    assert master["image"] == worker["image"]
    assert master["command"] == worker["command"]
    command = master["command"]
    assert command[0] == "torchrun" and command[-1] == "/app/train.py"
    assert int(flag(command, "nnodes")) == masters + workers
    assert int(flag(command, "nproc-per-node")) >= 1
    # what the operator sets in each pod, substituted by Kubernetes
    assert flag(command, "node-rank") == "$(RANK)"
    assert flag(command, "master-addr") == "$(MASTER_ADDR)"
    assert flag(command, "master-port") == "$(MASTER_PORT)"


def test_clusters_doc_shows_the_manifest_as_it_is():
    with open(DOC) as fh:
        doc = fh.read()
    with open(MANIFEST) as fh:
        manifest = fh.read()
    body = "".join(line for line in manifest.splitlines(True) if not line.startswith("#"))
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert body in blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HOROVOD_", "HVD_MAGIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _ranks(outs):
    """train.py's JSON lines from every process's output, in rank order."""
    return sorted((json.loads(line) for out in outs for line in out.splitlines()
                   if line.startswith("{")), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def manifest_job():
    """Each pod's command, with $(VAR)s as the operator sets them, started on this machine
    (both "pods" rendezvous at 127.0.0.1): (nnodes, nproc, train.py's lines by rank)."""
    pytest.importorskip("hvd_magic.collectives.controller",
                        reason="needs the torch.distributed controller (issue 36 item 1)")
    command = pod_commands(load())[0][2]["command"]
    nnodes, nproc = int(flag(command, "nnodes")), int(flag(command, "nproc-per-node"))
    port = str(_free_port())
    env = _clean_env()
    procs = []
    for node_rank in range(nnodes):
        pod = {"RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "WORLD_SIZE": str(nnodes)}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: pod[m.group(1)], a) for a in command]
        argv[0] = os.path.join(VENV_BIN, "torchrun")
        argv[-1] = TRAIN
        procs.append(subprocess.Popen(argv, env=dict(env, **pod), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return nnodes, nproc, _ranks(outs)


@pytest.mark.slow
def test_the_manifest_command_trains_on_every_rank(manifest_job):
    """train.py (import hvd_magic.torch as hvd) runs on nnodes x nproc-per-node ranks, with
    torchrun's local and cross ranks, that agree on the weights."""
    nnodes, nproc, ranks = manifest_job
    size = nnodes * nproc
    assert [r["rank"] for r in ranks] == list(range(size))
    assert all(r["size"] == size for r in ranks)
    assert [r["local_rank"] for r in ranks] == [i % nproc for i in range(size)]
    assert [r["cross_rank"] for r in ranks] == [i // nproc for i in range(size)]
    assert all(r["weights"] == ranks[0]["weights"] for r in ranks)


@pytest.mark.slow
def test_hvdrun_gloo_trains_train_py_to_the_manifests_weights(manifest_job):
    """The job the manifest describes and ``hvdrun --gloo -np N python train.py`` (the same
    script and ranks, started by hvdrun without MPI) end with the same weights."""
    pytest.importorskip("hvd_magic.runner.gloo_run", reason="needs hvdrun --gloo (issue 36 item 1)")
    nnodes, nproc, ranks = manifest_job
    size = nnodes * nproc
    proc = subprocess.run([os.path.join(VENV_BIN, "hvdrun"), "--gloo", "-np", str(size),
                           sys.executable, TRAIN], env=_clean_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    by_hvdrun = _ranks([proc.stdout])
    assert [r["rank"] for r in by_hvdrun] == list(range(size))
    for got, want in zip(by_hvdrun[0]["weights"], ranks[0]["weights"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
