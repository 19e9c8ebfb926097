# pandastack-workflows: every command creates what it needs from nothing.
# Airflow 3.3 and Prefect 3.9 cannot share one environment (FastAPI pins), so
# there are two virtual environments; the core and the local server are tested in both.
# Both install the local server's extra ([local]): the tests, the demo and e2e run on it.

PYTHON ?= python3
AF := .venv-airflow
PF := .venv-prefect
# Celery's tests and type check: a venv of its own (the core, the local server, Celery; no engine),
# so the e2e extra's pin of Celery for Airflow's CeleryExecutor never decides which Celery runs here.
CE := .venv-celery
PYTEST_ARGS ?=

.PHONY: help wheel venvs templates runsc lint typecheck test test-quick test-integration test-server test-core test-airflow-provider test-airflow-examples test-airflow-executor test-airflow-executor-stack test-unit test-celery test-fuzz test-floors test-conformance test-conformance-airflow test-conformance-prefect test-nonroot test-gvisor test-airflow test-prefect test-reliability test-soak test-e2e demo bench clean

help:
	@echo "make demo    run the example DAGs and flows on the embedded local PandaStack server"
	@echo "make test-unit   the unit tier (fakes, no server): seconds"
	@echo "make test-quick  unit tier, lint, types and the core against a real server: minutes"
	@echo "make test    lint, type-check and run every test of both environments (docs/testing.md)"
	@echo "make bench   run the benchmarks and regenerate benchmarks/RESULTS.md"
	@echo "make wheel   build dist/pandastack_workflows-*.whl to install into an engine's image"

# The distribution as a wheel (it is not on the package index): dist/pandastack_workflows-*.whl,
# installed with pip install 'dist/pandastack_workflows-0.1.0-py3-none-any.whl[airflow]' (or [prefect]).
wheel:
	$(PYTHON) -m pip wheel -q --disable-pip-version-check --no-deps -w dist .

$(AF)/.installed: pyproject.toml
	@test -x $(AF)/bin/python || $(PYTHON) -m venv $(AF)
	$(AF)/bin/pip install -q --disable-pip-version-check -e '.[airflow,local,queue,test,otel]'
	@touch $@

$(PF)/.installed: pyproject.toml
	@test -x $(PF)/bin/python || $(PYTHON) -m venv $(PF)
	$(PF)/bin/pip install -q --disable-pip-version-check -e '.[prefect,local,queue,test,otel]'
	@touch $@

$(CE)/.installed: pyproject.toml
	@test -x $(CE)/bin/python || $(PYTHON) -m venv $(CE)
	$(CE)/bin/pip install -q --disable-pip-version-check -e '.[celery,local,queue,test]'
	@touch $@

venvs: $(AF)/.installed $(PF)/.installed $(CE)/.installed

# The local server's templates: code-interpreter's data stack is built once into
# ~/.cache/pandastack-local (pip, the machine's own configuration) and reused by every
# server and test; base needs node on the host (the sandboxes see the host's /usr).
templates: $(AF)/.installed
	@command -v node >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs; }
	$(AF)/bin/pandastack-local templates build

lint: venvs
	$(AF)/bin/ruff check .
	$(AF)/bin/ruff format --check pandastack_jobs pandastack_local airflow_provider prefect_blocks pandastack_celery celery_app

typecheck: venvs
	$(AF)/bin/mypy pandastack_jobs pandastack_local airflow_provider demo
	$(PF)/bin/mypy prefect_blocks
	$(CE)/bin/mypy pandastack_celery celery_app

# The unit tier (tests/unit): the core's lifecycle, classification, detached jobs, reaping and pools,
# the executor's state machine, and the Airflow and Prefect adapters' translation, against in-memory
# fakes (pandastack_jobs.testing.FakeClient: the real SDK with its wire in memory;
# airflow_provider.executors.testing.FakeSandboxDriver). No server, sandbox, template, root or
# network: it needs only the venvs and runs in seconds. The core's files run in both venvs.
test-unit: venvs
	$(TIMED) test-unit-airflow $(AF)/bin/python -m pytest -q --timeout=60 tests/unit/core tests/unit/airflow \
		tests/unit/test_memory_guard_order.py tests/unit/test_oom_score_walk.py $(PYTEST_ARGS)
	$(TIMED) test-unit-prefect $(PF)/bin/python -m pytest -q --timeout=60 tests/unit/core tests/unit/prefect $(PYTEST_ARGS)
	$(TIMED) test-unit-celery $(CE)/bin/python -m pytest -q --timeout=60 tests/unit/celery $(PYTEST_ARGS)

# Which suite runs where, and why there (once per backend and privilege for the server's suites,
# once for the core, each engine's in its venv): docs/testing.md. Each leg prints its time
# (scripts/timed).
TIMED := scripts/timed

# tests/local/test_gvisor.py needs runsc: `make test-gvisor` runs it (after `make runsc`).
NO_GVISOR := --ignore=tests/local/test_gvisor.py

# The local server's suites (tests/local, tests/security) with bwrap, as the invoking user. The
# server imports no engine: they run once per backend and privilege (here, test-nonroot,
# test-gvisor), not once per engine venv.
test-server: venvs templates
	$(TIMED) test-server $(AF)/bin/python -m pytest -q tests/local tests/security $(NO_GVISOR) $(PYTEST_ARGS)

# The core against a real server (tests/jobs) and the docs' promises (tests/docs), once: in the
# Airflow venv (one docs test reads the executor's config block with Airflow). The one
# engine-dependent file (tests/jobs/test_packaging.py: each adapter imports in its engine's venv)
# also runs in test-prefect.
test-core: venvs templates
	$(TIMED) test-core $(AF)/bin/python -m pytest -q tests/jobs tests/docs $(PYTEST_ARGS)

# The executor's tests get pytest processes of their own. One interference between them and
# test_airflow_kill.py is found and fixed: the scheduler-stack fixture copied the live SQLite DB
# with a plain open and close, which drops this process's POSIX locks on it, so the next worker to
# close deleted the WAL under a SIGKILLed worker's commits (it now copies through SQLite's backup
# API; the three files pass in one process: 14 passed). The stack test's other symptom (every try
# failing after the unit tests in its process) was not reproduced since; the split stays until it is.
EXECUTOR_UNIT_TESTS := tests/airflow/test_airflow_executor.py tests/airflow/test_airflow_executor_driver.py
EXECUTOR_STACK_TEST := tests/airflow/test_airflow_executor_scheduler.py
# Three make targets (one pytest process each, its own server and its own copy of the migrated
# SQLite DB), so that `make -j` runs them side by side.
# The shipped example DAGs run whole (about half the provider's time): a target of their own.
EXAMPLES_TEST := tests/airflow/test_airflow_examples.py
test-airflow: test-airflow-provider test-airflow-examples test-airflow-executor test-airflow-executor-stack
test-airflow-provider: venvs templates
	$(TIMED) test-airflow-provider $(AF)/bin/python -m pytest -q tests/airflow \
		$(addprefix --ignore=,$(EXECUTOR_UNIT_TESTS) $(EXECUTOR_STACK_TEST) $(EXAMPLES_TEST)) $(PYTEST_ARGS)
test-airflow-examples: venvs templates
	$(TIMED) test-airflow-examples $(AF)/bin/python -m pytest -q $(EXAMPLES_TEST) $(PYTEST_ARGS)
test-airflow-executor: venvs templates
	$(TIMED) test-airflow-executor $(AF)/bin/python -m pytest -q $(EXECUTOR_UNIT_TESTS) $(PYTEST_ARGS)
test-airflow-executor-stack: venvs templates
	$(TIMED) test-airflow-executor-stack $(AF)/bin/python -m pytest -q $(EXECUTOR_STACK_TEST) $(PYTEST_ARGS)

# The fuzz leg (issue 24): schemathesis against the served /openapi.json of a real LocalServer, every
# operation a bounded number of examples (PANDASTACK_FUZZ_EXAMPLES, default 100), all its checks but
# "no 5xx" (the document lists the parity 500s): about a minute.
test-fuzz: venvs templates
	$(TIMED) test-fuzz $(AF)/bin/python -m pytest -q tests/fuzz --timeout=300 $(PYTEST_ARGS)

# Prefect's own suites, and the core's one engine-dependent file (see test-core).
test-prefect: venvs templates
	$(TIMED) test-prefect $(PF)/bin/python -m pytest -q tests/prefect tests/jobs/test_packaging.py $(PYTEST_ARGS)

# The local server's suites once more with the server run as an unprivileged user, created here
# (root only; a non-root developer's server is already unprivileged). docs/local-server.md says
# which walls need root. The harness makes the interpreter's and the temp dirs' parents
# traversable (o+x) for that user.
NONROOT_USER ?= pandastack-ci
NONROOT_TMP ?= /tmp/pandastack-nonroot-tests
test-nonroot: venvs templates
	@if [ "$$(id -u)" != 0 ]; then echo "test-nonroot: already not root: tests/local ran unprivileged"; exit 0; fi; \
	id -u $(NONROOT_USER) >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin $(NONROOT_USER); \
	PANDASTACK_LOCAL_SERVER_USER=$(NONROOT_USER) $(TIMED) test-nonroot $(AF)/bin/python -m pytest -q tests/local tests/security \
		$(NO_GVISOR) --basetemp=$(NONROOT_TMP) $(PYTEST_ARGS)

# The suites of `make test` after its fast checks, TEST_JOBS at a time: they wait on sandboxes,
# schedulers and servers far more than they use the CPU, and each is its own pytest process with
# its own server, state dir, ports and cgroups. Longest first; each leg's output kept whole.
# -k: one red suite does not stop the others (a red run shows every failure at once).
TEST_JOBS ?= 4
TEST_SUITES := test-server test-nonroot test-prefect test-airflow-provider test-airflow-examples \
	test-fuzz test-core test-airflow-executor-stack test-airflow-executor
test-integration: venvs templates
	$(MAKE) -k -j$(TEST_JOBS) --output-sync=target $(TEST_SUITES)

test: test-unit lint typecheck
	$(MAKE) test-integration

# For a contributor: the unit tier, lint, types and the core against a real server (tests/jobs,
# tests/docs), in a few minutes.
test-quick: test-unit lint typecheck test-core

# gVisor's runsc for `pandastack-local serve --isolation gvisor`, from Debian bookworm-backports
# (the 2022 build in bookworm main breaks `ls`): the script derives the backports source from the
# machine's own Debian source entry, installs, checks the version and runs a container. Fast
# when already there.
runsc:
	@bash scripts/install-runsc.sh

# The local server's suites again with every sandbox under gVisor (PANDASTACK_LOCAL_ISOLATION is
# LocalServer's default backend, so each suite's server fixture follows it): tests/local (with
# the gVisor backend's own tests/local/test_gvisor.py), tests/security and the hostile-job matrix
# through the core (test_rel_core_*). The engine files (test_rel_airflow.py, test_rel_prefect.py)
# translate the core's outcome, which the backend does not change: they run in test-reliability
# (docs/testing.md). Where a wall works differently under gVisor the test states each backend's
# outcome; the redeliver/dead-letter class never differs.
test-gvisor: venvs templates runsc
	PANDASTACK_LOCAL_ISOLATION=gvisor $(TIMED) test-gvisor-server $(AF)/bin/python -m pytest -q tests/local tests/security $(PYTEST_ARGS)
	PANDASTACK_LOCAL_ISOLATION=gvisor $(TIMED) test-gvisor-reliability $(AF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability \
		--ignore=tests/reliability/test_rel_prefect.py --ignore=tests/reliability/test_rel_airflow.py $(PYTEST_ARGS)

# Wire parity with the real PandaStack server (issue 13): our conformance tests through the SDK
# and raw HTTP against a fresh pandastack-local.
# Wire parity with PandaStack (docs/local-server.md, "Differences from PandaStack"): our route and
# field tests, and the pinned pandastack sdist's own live e2e tests and examples, downloaded at test
# time with the machine's pip configuration; the server is tested in both venvs.
# The two legs are independent (each its own fresh server and download): `make -j2 test-conformance`
# runs them side by side (CI does).
test-conformance: test-conformance-airflow test-conformance-prefect
test-conformance-airflow: venvs templates
	$(TIMED) test-conformance-airflow $(AF)/bin/python -m pytest -q tests/conformance $(PYTEST_ARGS)
test-conformance-prefect: venvs templates
	$(TIMED) test-conformance-prefect $(PF)/bin/python -m pytest -q tests/conformance $(PYTEST_ARGS)

# Hostile-job matrix and fault injection (docs/reliability.md): core + Airflow files in the Airflow
# venv, the Prefect file in the Prefect venv. The soaks are marked slow: make test-soak.
RELIABILITY_MARK ?= reliability and not slow
test-reliability: venvs templates
	$(TIMED) test-reliability-airflow $(AF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability \
		--ignore=tests/reliability/test_rel_prefect.py $(PYTEST_ARGS)
	$(TIMED) test-reliability-prefect $(PF)/bin/python -m pytest -q -m "$(RELIABILITY_MARK)" tests/reliability/test_rel_prefect.py $(PYTEST_ARGS)

test-soak: venvs
	$(MAKE) test-reliability RELIABILITY_MARK="reliability and slow"

# Queue workers (issue 28, docs/queues.md): the consumer on real Redis, PostgreSQL, RabbitMQ and
# moto's SQS-compatible server, each started by the tests on loopback and free ports, with the
# Airflow operator (tests/queue/airflow, Airflow venv) and the Prefect flow (tests/queue/prefect,
# Prefect venv) side by side. Installs the brokers (apt) and the queue extra when missing; stops
# everything it started, whatever happens.
.PHONY: test-queue
test-queue: venvs templates
	$(TIMED) test-queue tests/queue/run.sh $(PYTEST_ARGS)

# Metrics and traces (issue 38, docs/observability.md): /metrics of a real server and a real consumer
# on a real Redis parsed with prometheus_client, Debian's prometheus scraping both, the span trees
# through Redis, Airflow and Prefect with the OpenTelemetry SDK's in-memory exporter. Installs
# prometheus and redis-server (apt) when missing. About a minute.
.PHONY: test-observability
test-observability: venvs templates
	tests/observability/run.sh $(PYTEST_ARGS)

# Celery (docs/celery.md): sandbox tasks on real `celery worker` processes, real Redis and
# RabbitMQ brokers (a Redis result backend) and a real local server, each started by the tests on
# loopback and free ports: results, retries, dead-letters, a SIGKILLed worker and pool process, a
# broker restart, a memory hog, revoke(terminate=True), time limits. Installs the brokers (apt)
# when missing; stops everything it started, whatever happens. About 2 minutes.
.PHONY: test-celery
test-celery: $(CE)/.installed templates
	CE=$(CE) tests/celery_tasks/run.sh $(PYTEST_ARGS)

# Production topology e2e (issue 9): PostgreSQL, Redis, the local PandaStack server, Airflow
# with CeleryExecutor and two workers, Prefect server with a process pool and two workers.
# Installs what is missing; stops everything it started, whatever happens.
test-e2e: venvs templates
	$(TIMED) test-e2e e2e/run.sh $(PYTEST_ARGS)

# The floor engine versions (issue 25; README, "Engine versions"): Airflow 3.1 and 3.2 and Prefect
# 3.6, each in a venv of its own under .venv-floors/, pinned by constraints/*.txt (pip freeze of a
# resolve from the package index, through the machine's own pip configuration; airflow-3.2.txt also
# caps fastapi and svcs, which 3.2.2 needs and does not declare: see its header). Light: install,
# import, one real dag.test() / flow with a redelivered failure and a dead-letter (tests/floors),
# plus the Prefect first-hour tests (default block, worker check, plain-function retry condition).
# Uses the local server's built templates (make templates; CI has them from make test).
FLOORS := .venv-floors
FLOOR_ENGINE_airflow-3.1 := airflow
FLOOR_ENGINE_airflow-3.2 := airflow
FLOOR_ENGINE_prefect-3.6 := prefect
# Prefect 3.6's worker module imports importlib_metadata without declaring it.
FLOOR_EXTRA_prefect-3.6 := importlib_metadata
$(FLOORS)/%/.installed: constraints/%.txt pyproject.toml
	@test -x $(FLOORS)/$*/bin/python || $(PYTHON) -m venv $(FLOORS)/$*
	$(FLOORS)/$*/bin/pip install -q --disable-pip-version-check -c constraints/$*.txt \
		-e '.[$(FLOOR_ENGINE_$*),local]' pytest pytest-timeout httpx $(FLOOR_EXTRA_$*)
	@touch $@

test-floors: $(FLOORS)/airflow-3.1/.installed $(FLOORS)/airflow-3.2/.installed $(FLOORS)/prefect-3.6/.installed
	$(TIMED) test-floors-airflow-3.1 $(FLOORS)/airflow-3.1/bin/python -m pytest -q -p no:cacheprovider tests/floors $(PYTEST_ARGS)
	$(TIMED) test-floors-airflow-3.2 $(FLOORS)/airflow-3.2/bin/python -m pytest -q -p no:cacheprovider tests/floors $(PYTEST_ARGS)
	$(TIMED) test-floors-prefect-3.6 $(FLOORS)/prefect-3.6/bin/python -m pytest -q -p no:cacheprovider tests/floors \
		tests/prefect/test_prefect_newcomer.py $(PYTEST_ARGS)

# The queue part needs the Redis client (the queue extra); demo/redis_server.py installs
# Debian's redis-server if missing and runs its own on a free loopback port.
demo: venvs templates
	@$(AF)/bin/python -c 'import redis' 2>/dev/null || $(AF)/bin/pip install -q --disable-pip-version-check -e '.[airflow,local,test,queue]'
	$(AF)/bin/python -m demo

# The Kafka step (benchmarks/kafka.py) starts the queue tests' own Kafka (e2e/brokers.py):
# a Java runtime and Maven for its jars, installed here when missing, as tests/queue/run.sh does.
bench: venvs templates
	@$(AF)/bin/python -c 'import matplotlib' 2>/dev/null || $(AF)/bin/pip install -q --disable-pip-version-check -e '.[bench]'
	@command -v java >/dev/null && command -v mvn >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openjdk-17-jre-headless maven; }
	$(AF)/bin/python -m benchmarks.run

clean:
	rm -rf $(AF) $(PF) $(CE) $(FLOORS) dist build .mypy_cache .ruff_cache .pytest_cache
