# pandastack-workflows: every command creates what it needs from nothing.
# Airflow 3.3 and Prefect 3.9 cannot share one environment (FastAPI pins), so
# there are two virtual environments; the core and the local server are tested in both.
# Both install the local server's extra ([local]): the tests, the demo and e2e run on it.

PYTHON ?= python3
AF := .venv-airflow
PF := .venv-prefect
PYTEST_ARGS ?=

.PHONY: help venvs templates runsc lint typecheck test test-fuzz test-conformance test-conformance-airflow test-conformance-prefect test-nonroot test-gvisor test-airflow test-prefect test-reliability test-soak test-e2e demo bench clean

help:
	@echo "make demo    run the example DAGs and flows on the embedded local PandaStack server"
	@echo "make test    lint, type-check and run every test in both environments"
	@echo "make bench   run the benchmarks and regenerate benchmarks/RESULTS.md"

$(AF)/.installed: pyproject.toml
	@test -x $(AF)/bin/python || $(PYTHON) -m venv $(AF)
	$(AF)/bin/pip install -q --disable-pip-version-check -e '.[airflow,local,test]'
	@touch $@

$(PF)/.installed: pyproject.toml
	@test -x $(PF)/bin/python || $(PYTHON) -m venv $(PF)
	$(PF)/bin/pip install -q --disable-pip-version-check -e '.[prefect,local,test]'
	@touch $@

venvs: $(AF)/.installed $(PF)/.installed

# The local server's templates: code-interpreter's data stack is built once into
# ~/.cache/pandastack-local (pip, the machine's own configuration) and reused by every
# server and test; base needs node on the host (the sandboxes see the host's /usr).
templates: $(AF)/.installed
	@command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs; }
	$(AF)/bin/pandastack-local templates build

lint: venvs
	$(AF)/bin/ruff check .
	$(AF)/bin/ruff format --check pandastack_jobs pandastack_local airflow_provider prefect_blocks

typecheck: venvs
	$(AF)/bin/mypy pandastack_jobs pandastack_local airflow_provider demo
	$(PF)/bin/mypy prefect_blocks

# tests/local/test_gvisor.py needs runsc: `make test-gvisor` runs it (after `make runsc`).
NO_GVISOR := --ignore=tests/local/test_gvisor.py

# The executor's tests get pytest processes of their own: in one process with them, the
# SIGKILLed-worker test of test_airflow_kill.py found none of its worker's writes in the session's
# SQLite DB (WAL mode, written by dag.test in this process), and the scheduler-stack test, which
# starts from a copy of that DB, saw every try fail when the unit tests ran before it in its
# process. Each passes in a process of its own; the cause is not pinned down yet.
EXECUTOR_UNIT_TESTS := tests/airflow/test_airflow_executor.py tests/airflow/test_airflow_executor_driver.py
EXECUTOR_STACK_TEST := tests/airflow/test_airflow_executor_scheduler.py
test-airflow: venvs templates
	$(AF)/bin/python -m pytest -q tests/local tests/security tests/jobs tests/airflow $(NO_GVISOR) \
		$(addprefix --ignore=,$(EXECUTOR_UNIT_TESTS) $(EXECUTOR_STACK_TEST)) $(PYTEST_ARGS)
	$(AF)/bin/python -m pytest -q $(EXECUTOR_UNIT_TESTS) $(PYTEST_ARGS)
	$(AF)/bin/python -m pytest -q $(EXECUTOR_STACK_TEST) $(PYTEST_ARGS)

# The fuzz leg (issue 24): schemathesis against the served /openapi.json of a real LocalServer, every
# operation a bounded number of examples (PANDASTACK_FUZZ_EXAMPLES, default 100), all its checks but
# "no 5xx" (the document lists the parity 500s): about a minute.
test-fuzz: venvs templates
	$(AF)/bin/python -m pytest -q tests/fuzz --timeout=300 $(PYTEST_ARGS)

test-prefect: venvs templates
	$(PF)/bin/python -m pytest -q tests/local tests/jobs tests/prefect $(NO_GVISOR) $(PYTEST_ARGS)

# The local server's suites once more with the server run as an unprivileged user, created here
# (root only; a non-root developer's server is already unprivileged). docs/local-server.md says
# which walls need root. The harness makes the interpreter's and the temp dirs' parents
# traversable (o+x) for that user.
NONROOT_USER ?= pandastack-ci
NONROOT_TMP ?= /tmp/pandastack-nonroot-tests
test-nonroot: venvs templates
	@if [ "$$(id -u)" != 0 ]; then echo "test-nonroot: already not root: tests/local ran unprivileged"; exit 0; fi; \
	id -u $(NONROOT_USER) >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin $(NONROOT_USER); \
	PANDASTACK_LOCAL_SERVER_USER=$(NONROOT_USER) $(AF)/bin/python -m pytest -q tests/local tests/security \
		$(NO_GVISOR) --basetemp=$(NONROOT_TMP) $(PYTEST_ARGS)

test: lint typecheck test-airflow test-fuzz test-prefect test-nonroot

# gVisor's runsc for `pandastack-local serve --isolation gvisor`, from Debian bookworm-backports
# (the 2022 build in bookworm main breaks `ls`): the script derives the backports source from the
# machine's own Debian source entry, installs, checks the version and runs a container. Fast
# when already there.
runsc:
	@bash scripts/install-runsc.sh

# The local server's suites again with every sandbox under gVisor (PANDASTACK_LOCAL_ISOLATION is
# LocalServer's default backend, so each suite's server fixture follows it): tests/local (with
# the gVisor backend's own tests/local/test_gvisor.py), tests/security and the hostile-job matrix
# (core + Airflow files; the Prefect file runs the same core lifecycle in the other venv and is
# left out to keep this leg under 10 min: 500 s here, beside other suites). Where a wall works
# differently under gVisor the test states each backend's outcome; the redeliver/dead-letter
# class never differs.
test-gvisor: venvs templates runsc
	PANDASTACK_LOCAL_ISOLATION=gvisor $(AF)/bin/python -m pytest -q tests/local tests/security $(PYTEST_ARGS)
	PANDASTACK_LOCAL_ISOLATION=gvisor $(AF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability \
		--ignore=tests/reliability/test_rel_prefect.py $(PYTEST_ARGS)

# Wire parity with the real PandaStack server (issue 13): our conformance tests through the SDK
# and raw HTTP against a fresh pandastack-local.
# Wire parity with PandaStack (docs/local-server.md, "Differences from PandaStack"): our route and
# field tests, and the pinned pandastack sdist's own live e2e tests and examples, downloaded at test
# time with the machine's pip configuration; the server is tested in both venvs.
# The two legs are independent (each its own fresh server and download): `make -j2 test-conformance`
# runs them side by side (CI does).
test-conformance: test-conformance-airflow test-conformance-prefect
test-conformance-airflow: venvs templates
	$(AF)/bin/python -m pytest -q tests/conformance $(PYTEST_ARGS)
test-conformance-prefect: venvs templates
	$(PF)/bin/python -m pytest -q tests/conformance $(PYTEST_ARGS)

# Hostile-job matrix and fault injection (docs/reliability.md): core + Airflow files in the Airflow
# venv, the Prefect file in the Prefect venv. The soaks are marked slow: make test-soak.
RELIABILITY_MARK ?= reliability and not slow
test-reliability: venvs templates
	$(AF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability \
		--ignore=tests/reliability/test_rel_prefect.py $(PYTEST_ARGS)
	$(PF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability/test_rel_prefect.py $(PYTEST_ARGS)

test-soak: venvs
	$(MAKE) test-reliability RELIABILITY_MARK="reliability and slow"

# Production topology e2e (issue 9): PostgreSQL, Redis, the local PandaStack server, Airflow
# with CeleryExecutor and two workers, Prefect server with a process pool and two workers.
# Installs what is missing; stops everything it started, whatever happens.
test-e2e: venvs templates
	e2e/run.sh $(PYTEST_ARGS)

demo: venvs templates
	$(AF)/bin/python -m demo

bench: venvs templates
	@$(AF)/bin/python -c 'import matplotlib' 2>/dev/null || $(AF)/bin/pip install -q --disable-pip-version-check -e '.[bench]'
	$(AF)/bin/python -m benchmarks.run

clean:
	rm -rf $(AF) $(PF) .mypy_cache .ruff_cache .pytest_cache
