# make demo: create .venv, install, run the main job on the embedded LocalCluster.
# make test: create .venv, install, run the tests.
# make notebook: install the [notebook] extra, register the kernel, open JupyterLab on notebooks/
#   (on 127.0.0.1 only; as root too, a container's usual user).
# make notebooks: rerun every notebook and save it with its outputs (commit them: figures on the web).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv bench clean notebook notebooks dask-config

venv: $(STAMP)

$(STAMP): setup.cfg setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip "setuptools<81" wheel
	# Chainer 7.8.1's sdist imports pkg_resources at build time: no build isolation.
	$(PY) -m pip install -q --no-build-isolation chainer==7.8.1
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipeline demo --out runs/demo --overwrite  # make demo replaces its own run

test: $(STAMP)
	$(PY) -m pytest --durations=25

# The kernel is registered inside .venv (--sys-prefix) under the name the notebooks ask for
# (python3), so this JupyterLab runs them on .venv's Python, whatever other kernels exist.
# JupyterLab refuses root without --allow-root; USER_ID=1000 make -n notebook shows the other case.
USER_ID ?= $(shell id -u)
notebook: $(STAMP) dask-config
	$(PY) -m pip install -q --no-build-isolation -e ".[notebook]"
	$(PY) -m ipykernel install --sys-prefix --name python3 \
		--display-name "Python 3 (dask-chainer-pipeline)"
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 $(if $(filter 0,$(USER_ID)),--allow-root) notebooks/

# The Dask panel's clusters on 127.0.0.1 (etc/dask/ says why): into a directory dask reads.
dask-config:
	install -D -m 644 etc/dask/dask-chainer-pipeline.yaml $(VENV)/etc/dask/dask-chainer-pipeline.yaml

# On the [test] extra's nbclient and ipykernel, in a fresh kernel per notebook; ~5 minutes on 2 cores.
notebooks: $(STAMP)
	$(PY) scripts/run_notebooks.py

# peer.py runs when PEER_TORCH_PYTHON names a Python with torch (benchmarks/peer.py says how).
bench: $(STAMP)
	for b in benchmarks/[!_]*.py; do \
		if [ "$$b" = benchmarks/peer.py ] && [ -z "$$PEER_TORCH_PYTHON" ]; then continue; fi; \
		$(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
