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
# MACHINE_MODULES, which make namespace hosts, shape links, start a Ray or a Slurm, or drive
# a browser, form one group: they count processes and ports machine-wide or time links, so
# they run one after another, never two at once.
MACHINE = "machine"
MACHINE_MODULES = {"test_browser", "test_doctor", "test_gloo_hosts", "test_multihost",
                   "test_ray", "test_ray_pool", "test_slurm", "test_whatif"}


def group_of(nodeid: str) -> str:
    """The group of a test, from its node id.

    >>> group_of("tests/test_ray.py::test_x[2]"), group_of("notebooks/a.ipynb::Cell 1")
    ('machine', 'notebooks/a.ipynb')
    """
    path = nodeid.split("::", 1)[0]
    return MACHINE if Path(path).stem in MACHINE_MODULES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scheduler by scope (largest first), the scope being :func:`group_of`."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)
