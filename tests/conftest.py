import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture
def one_rank():
    """The runtime on this process alone (no mpiexec), shut down afterwards unless it was
    already running (other tests expect it off)."""
    import hvd_magic.collectives as hvd
    was = hvd.is_initialized()
    hvd.init()
    yield
    if not was:
        hvd.shutdown()


@pytest.fixture(scope="module")
def two_hosts():
    """Two "hosts" (network namespaces joined by a veth pair, see netns_hosts.py); skips
    when they cannot be made here (not root, no `ip netns`). Everything still running in
    them afterwards is killed, and they are deleted, also when a test failed."""
    import netns_hosts
    why = netns_hosts.unusable_reason()
    if why:
        pytest.skip(why)
    netns_hosts.clean_stale()
    hosts = netns_hosts.TwoHosts().create()
    try:
        yield hosts
    finally:
        hosts.destroy()


# ---------------------------------------------------------------- two test processes
#
# `make test` runs the suite in two pytest-xdist workers (`-n 2`): much of the suite's time
# is waiting (stall and liveness timeouts, launches, Slurm, Ray), which the other worker
# fills. A worker takes one group of tests at a time: a module (or a notebook), so that its
# module fixtures and a notebook's cells stay in one process; except that the modules in
# MACHINE_MODULES, which make namespace hosts, start a Ray or a Slurm, or drive a browser,
# form one group: they count processes and ports machine-wide, so they run one after
# another, never two at once. The tests in SOLO (modules, or module::test) run the doctor
# and need its timings to mean something: they compare them with a shaped link's rate (the
# doctor, the what-if check), or need a sweep that fits a bandwidth (the panel's prediction
# from the doctor). Beside another test's MPI ranks, which spin on both cores, their ranks
# wait for a core mid-measurement: figures off by a third, sweeps that fit no bandwidth.
# They form the group run last, alone: it waits until the other worker has finished.
MACHINE = "machine"
MACHINE_MODULES = {"test_browser", "test_gloo_hosts", "test_multihost", "test_ray",
                   "test_ray_pool", "test_slurm"}
SOLO = "solo"
SOLO_TESTS = {"test_doctor", "test_whatif",
              "test_browser::test_predicted_beside_measured_in_jupyterlab"}


def group_of(nodeid: str) -> str:
    """The group of a test, from its node id.

    >>> group_of("tests/test_ray.py::test_x[2]"), group_of("notebooks/a.ipynb::Cell 1")
    ('machine', 'notebooks/a.ipynb')
    >>> group_of("tests/test_doctor.py::test_y"), group_of("tests/test_browser.py::test_z")
    ('solo', 'machine')
    >>> group_of("tests/test_browser.py::test_predicted_beside_measured_in_jupyterlab[ray]")
    'solo'
    """
    path, _, test = nodeid.partition("::")
    stem = Path(path).stem
    if stem in SOLO_TESTS or f"{stem}::{test.split('[', 1)[0]}" in SOLO_TESTS:
        return SOLO
    return MACHINE if stem in MACHINE_MODULES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scheduler by scope (largest first), the scope being :func:`group_of`;
        the solo group goes last, to one worker, once the others have run all their tests."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if SOLO in self.workqueue and len(self.workqueue) > 1:
                self.workqueue.move_to_end(SOLO)
            if list(self.workqueue) == [SOLO]:
                self._solo_when_alone()
            else:
                super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            if list(self.workqueue) == [SOLO]:
                self._solo_when_alone()         # asked again each time a test completes
            else:
                super()._reschedule(node)

        def _solo_when_alone(self) -> None:
            # An xdist worker keeps its last test until it is given more or told to end: so
            # every worker but one is told to end, and the one left is given the solo group
            # when those have no test left.
            live = [n for n in self.nodes if not n.shutting_down]
            if not live:
                return
            taker = live[0]
            for other in live[1:]:
                other.shutdown()
            if not any(self._pending_of(self.assigned_work[n]) for n in self.nodes
                       if n is not taker):
                super()._assign_work_unit(taker)

    return ByGroup(config, log)
