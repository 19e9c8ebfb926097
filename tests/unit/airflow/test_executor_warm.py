"""Warm starts' bookkeeping in ``PandaStackDriver`` and the executor's option, on :class:`FakeClient`
with a scripted pool (the real pool against a real server: tests/airflow/test_airflow_executor_warm.py).

What must hold: a fitting try takes a ready standby and is fenced by that standby's id (its
metadata cannot name the try); a scheduler that never saw the launch still finds and fences it
(the request file); idle standbys are never taken for tries; anything that does not fit, or no
ready standby, goes cold exactly as without pools; ``warm_pool_size`` is validated.

The sweep reads a request file only where its owner is gone (an exec resets the standby's idle
TTL): never its own waiting standbys, never a live or unknown owner's; a gone owner's idle
standby is deleted. The owner check is opaque to the driver (here: the ``owner`` label; the
executor's reads Airflow's scheduler jobs, tests/unit/airflow/test_executor_standby_owners.py).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from airflow_provider.executors.driver import REQUEST_LABEL, REQUEST_PATH, PandaStackDriver
from airflow_provider.executors.models import SandboxConfigurationError, SandboxLaunchRequest
from airflow_provider.executors.options import read_section
from airflow_provider.executors.warm import fits
from pandastack_jobs import ConnectionConfig, DetachedJob, Standby, WarmStart
from pandastack_jobs.testing import FAKE_KEY, FakeClient, Script
from pandastack_jobs.warm_start import ATTACH_PATH, STANDBY_LABEL

MODULE = "airflow.sdk.execution_time.execute_workload"
ENV = {"AIRFLOW__CORE__DAGS_FOLDER": "/dags", "AIRFLOW_HOME": "/work/airflow"}
WARM = WarmStart(template="airflow-worker", python="/venv/bin/python", modules=(MODULE,), env=ENV)
LABELS = {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1", "try_number": "1"}
OWNER_A = {"owner": "A"}  # what the executor puts on its standbys, opaque to the driver


class ScriptedPool:
    """A pool whose standbys are sandboxes made at ``start`` on the fake server."""

    made: list[ScriptedPool] = []

    def __init__(self, fake: FakeClient, warm: WarmStart, size: int, metadata: dict[str, str]) -> None:
        self.fake, self.warm, self.size, self.metadata = fake, warm, size, metadata
        self.ready: list[str] = []
        self.taken = 0
        self.closed = False

    def start(self) -> None:
        meta = {**self.metadata, STANDBY_LABEL: self.warm.key()}
        self.ready = [
            self.fake.add_sandbox(metadata=meta, template=self.warm.template).id for _ in range(self.size)
        ]

    def take(self) -> Standby | None:
        self.taken += 1
        return Standby(self.ready.pop(0), self.warm) if self.ready else None

    def close(self) -> None:
        self.closed = True
        for sandbox_id in self.ready:
            self.fake.expire(sandbox_id)
        self.ready = []


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient(templates=("code-interpreter", "airflow-worker"))


@pytest.fixture
def driver(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> PandaStackDriver:
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    # What the sandbox answers when a driver reads a standby's request file (bounded by dd).
    fake.script(
        lambda command: REQUEST_PATH in command,
        action=lambda sb, call: Script(stdout=sb.files.get(REQUEST_PATH, b"").decode()),
    )
    return PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY))


def warm_driver(
    driver: PandaStackDriver, fake: FakeClient, size: int = 1, owner: dict[str, str] | None = None
) -> ScriptedPool:
    pools: list[ScriptedPool] = []

    def factory(client_factory: Any, warm: WarmStart, *, size: int, metadata: Any, **kwargs: Any) -> Any:
        pools.append(ScriptedPool(fake, warm, size, metadata))
        return pools[-1]

    extra = {} if owner is None else {"owner": owner}
    assert driver.open_standbys([WARM], size, pool_factory=factory, **extra) == [WARM.key()]
    return pools[0]


def other_scheduler(*, gone: tuple[str, ...] = (), live: tuple[str, ...] = ()) -> PandaStackDriver:
    """The driver of another (or a restarted) scheduler: its owner check calls the owners named
    in ``gone`` gone and in ``live`` alive; any other owner (or none) is unknown."""

    def owners_alive(metadata: Any) -> list[bool | None]:
        owners = [meta.get("owner") for meta in metadata]
        return [False if o in gone else True if o in live else None for o in owners]

    return PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY), owners_alive=owners_alive)


def execs_into(fake: FakeClient, sandbox_ids: Any, since: int = 0) -> list[str]:
    return [call.sandbox_id for call in fake.execs[since:] if call.sandbox_id in set(sandbox_ids)]


def request(
    *, template: str = "airflow-worker", env: dict[str, str] | None = None, python: str = "/venv/bin/python"
) -> SandboxLaunchRequest:
    return SandboxLaunchRequest(
        str(uuid.uuid4()),
        (python, "-m", MODULE, "--json-string", '{"ti": 1}'),
        dict(ENV if env is None else env),
        provider_config={"template": template, "labels": LABELS},
        workdir=None,
        timeout_seconds=60,
        ttl_seconds=120,
    )


def launch(driver: PandaStackDriver, req: SandboxLaunchRequest) -> dict[str, Any]:
    return dict(asyncio.run(driver.launch(req)).data)


def test_warm_pool_size_is_validated_naming_the_option() -> None:
    def size(value: Any) -> tuple[Any, list[str]]:
        values, problems = read_section(lambda s, o, fallback=None: value if o == "warm_pool_size" else None)
        return values["warm_pool_size"] if not problems else None, problems

    assert [size(v)[0] for v in (None, "", "0", " 3 ")] == [0, 0, 0, 3]
    for bad in ("two", "-1", "65", "1.5"):
        assert size(bad)[1] == [
            f"[pandastack_executor] warm_pool_size: {bad!r} is not a whole number from 0 to 64: the ready "
            "standbys to keep, e.g. 2 (0 turns warm starts off)"
        ]


def test_a_standby_fits_only_the_same_template_interpreter_module_and_import_env() -> None:
    argv = ("/venv/bin/python", "-m", MODULE, "--json-string", "{}")
    assert fits(WARM, "airflow-worker", argv, ENV)
    assert fits(WARM, "airflow-worker", argv, {**ENV, "TENANT": "acme"})  # reaches os.environ at run time
    assert not fits(WARM, "other", argv, ENV)
    assert not fits(WARM, "airflow-worker", ("python3", *argv[1:]), ENV)
    assert not fits(WARM, "airflow-worker", ("/venv/bin/python", "-c", "x"), ENV)
    assert not fits(WARM, "airflow-worker", argv, {**ENV, "AIRFLOW__CORE__DAGS_FOLDER": "/other"})
    assert not fits(WARM, "airflow-worker", argv, {**ENV, "PYTHONPATH": "/x"})  # read at start-up


def test_a_fitting_try_runs_in_a_standby_and_is_fenced_by_its_id(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    pool = warm_driver(driver, fake)
    standby_id = pool.ready[0]
    req = request(env={**ENV, "TENANT": "acme"})
    data = launch(driver, req)
    assert data["sandbox_id"] == standby_id and data["standby"] == WARM.key()
    sb = fake.sandbox(standby_id)
    assert REQUEST_LABEL not in sb.metadata and sb.ttl_seconds == 120  # claimed with the try's TTL
    call = fake.execs[-1]
    assert call.detached and ATTACH_PATH in call.command and MODULE in call.command
    assert call.env["TENANT"] == "acme" and FAKE_KEY not in call.line
    assert json.loads(sb.files[REQUEST_PATH]) == {"request_id": req.request_id, "labels": LABELS}
    other = fake.add_sandbox(metadata={STANDBY_LABEL: WARM.key(), "job_engine": "airflow-executor"})
    asyncio.run(driver.fence(req.request_id))
    assert fake.live() == [other.id]  # the try's standby, and not an idle one


def test_a_scheduler_that_never_saw_the_launch_finds_and_fences_the_standby_try(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    pool = warm_driver(driver, fake, size=2, owner=OWNER_A)
    idle = pool.ready[1]
    req = request()
    standby_id = launch(driver, req)["sandbox_id"]
    assert asyncio.run(driver.list_requests()) == {}  # its own launcher knows it (no file read)
    fenced = PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY))  # no owner check: the fence reads all
    asyncio.run(fenced.fence(req.request_id))
    assert standby_id not in fake.live() and idle in fake.live()


def test_a_sweep_never_execs_into_its_own_waiting_standbys(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    """Its pool knows they are idle, and each exec would be activity resetting their idle TTL."""
    pool = warm_driver(driver, fake, size=3, owner=OWNER_A)
    launch(driver, request())
    waiting, before = list(pool.ready), len(fake.execs)
    assert asyncio.run(driver.list_requests()) == {}
    asyncio.run(driver.fence(str(uuid.uuid4())))  # a request it never launched: read the others' only
    assert execs_into(fake, waiting, before) == [] and set(waiting) <= set(fake.live())


def test_a_gone_schedulers_idle_standby_is_deleted_and_its_taken_one_still_found(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    """A killed scheduler's idle standbys would otherwise live on (every read is activity), and
    its tries in taken standbys must still reach the orphan sweep and the fence."""
    pool = warm_driver(driver, fake, size=2, owner=OWNER_A)
    idle = pool.ready[1]
    req = request()
    taken = launch(driver, req)["sandbox_id"]
    restarted = other_scheduler(gone=("A",))
    assert asyncio.run(restarted.list_requests()) == {req.request_id: LABELS}
    assert idle not in fake.live() and taken in fake.live()
    asyncio.run(restarted.fence(req.request_id))
    assert taken not in fake.live()


def test_a_live_or_unknown_owners_standbys_are_neither_read_nor_deleted_by_the_sweep(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    """A live owner's standbys are its pool's and its tries its own; an unknown owner's (no owner
    on the metadata: made before owners were named, or a job this DB does not know) are left to
    their idle TTL, which a read would reset. A fence still reads them all: it must find every
    claimant of its request, whoever made the standby."""
    pool = warm_driver(driver, fake, size=2, owner=OWNER_A)
    req = request()
    taken = launch(driver, req)["sandbox_id"]
    legacy = fake.add_sandbox(metadata={STANDBY_LABEL: WARM.key(), "job_engine": "airflow-executor"})
    stranger = fake.add_sandbox(metadata={STANDBY_LABEL: "k", "job_engine": "airflow-executor", "owner": "Z"})
    everyone = [*pool.ready, taken, legacy.id, stranger.id]
    other, before = other_scheduler(live=("A",)), len(fake.execs)
    assert asyncio.run(other.list_requests()) == {}
    assert execs_into(fake, everyone, before) == [] and sorted(fake.live()) == sorted(everyone)
    asyncio.run(other.fence(req.request_id))
    assert sorted(fake.live()) == sorted([*pool.ready, legacy.id, stranger.id])


def test_an_owner_check_that_fails_leaves_every_standby_alone(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    pool = warm_driver(driver, fake, size=1, owner=OWNER_A)

    def broken(metadata: Any) -> list[bool | None]:
        raise RuntimeError("the metadata DB is down")

    other, before = PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY), owners_alive=broken), len(fake.execs)
    assert asyncio.run(other.list_requests()) == {}
    assert execs_into(fake, pool.ready, before) == [] and pool.ready[0] in fake.live()


def test_a_try_that_does_not_fit_goes_cold_without_touching_the_pool(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    pool = warm_driver(driver, fake)
    for req in (request(template="code-interpreter"), request(env={**ENV, "AIRFLOW_HOME": "/x"})):
        data = launch(driver, req)
        assert "standby" not in data and data["sandbox_id"] not in pool.ready
        assert fake.sandbox(data["sandbox_id"]).metadata[REQUEST_LABEL] == req.request_id
    assert pool.taken == 0 and len(pool.ready) == 1


def test_with_no_ready_standby_or_a_gone_one_the_try_goes_cold_as_without_pools(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    cold = PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY))
    launch(cold, request())
    baseline = fake.execs[-1].command
    pool = warm_driver(driver, fake)
    fake.expire(pool.ready[0])  # deleted behind the pool's back: the core creates a fresh sandbox
    gone = launch(driver, request())
    assert "standby" not in gone and fake.execs[-1].command == baseline
    empty = launch(driver, request())  # the pool has nothing ready now
    assert pool.taken == 2 and "standby" not in empty and fake.execs[-1].command == baseline
    for data in (gone, empty):
        assert REQUEST_LABEL in fake.sandbox(DetachedJob.from_dict(data).sandbox_id).metadata


def test_size_zero_opens_no_pool_and_close_closes_the_pools(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no pool at warm_pool_size = 0")

    assert driver.open_standbys([WARM], 0, pool_factory=boom) == []
    pool = warm_driver(driver, fake, size=2)
    launch(driver, request())
    asyncio.run(driver.close())
    assert pool.closed and len(fake.live()) == 1  # the untaken one deleted, the try's left to its end


def test_the_executor_reads_warm_pool_size_and_warms_the_sections_runtime_env(
    logs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_provider.executors.pandastack_executor import PandaStackExecutor

    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE", "many")
    with pytest.raises(SandboxConfigurationError, match=r"\[pandastack_executor\] warm_pool_size: 'many'"):
        PandaStackExecutor()
    monkeypatch.delenv("AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE")
    assert PandaStackExecutor().warm_pool_size == 0
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE", "2")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ENV", '{"TENANT": "acme"}')
    executor = PandaStackExecutor()
    warm = executor.warm_start()
    assert executor.warm_pool_size == 2 and warm.modules == (MODULE,) and warm.python == executor.python
    assert warm.template == executor.launch_config.template
    assert warm.env == executor.runtime_env({"TENANT": "acme"})
    assert warm.env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://api.invalid/execution/"


def test_a_json_bomb_in_one_tries_request_file_does_not_blind_the_sweep_or_the_fence(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    """A try owns its standby, so it can rewrite its request file: 4096 ``[`` (within the
    read bound) makes ``json.loads`` raise RecursionError, which must not escape."""
    pool = warm_driver(driver, fake, size=2, owner=OWNER_A)
    honest, hostile = request(), request()
    honest_id = launch(driver, honest)["sandbox_id"]
    hostile_id = launch(driver, hostile)["sandbox_id"]
    fake.sandbox(hostile_id).files[REQUEST_PATH] = b"[" * 4096
    restarted = other_scheduler(gone=("A",))
    assert asyncio.run(restarted.list_requests()) == {honest.request_id: LABELS}
    asyncio.run(restarted.fence(honest.request_id))
    assert honest_id not in fake.live() and hostile_id in fake.live() and pool.taken == 2


def test_a_try_claiming_another_tries_request_id_cannot_hide_that_try_from_the_fence(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    """A hostile try writes the victim's request id into its own request file: a scheduler that
    never saw the launches must still fence the victim's standby (every claimant is fenced)."""
    warm_driver(driver, fake, size=2)
    victim, hostile = request(), request()
    victim_id = launch(driver, victim)["sandbox_id"]
    hostile_id = launch(driver, hostile)["sandbox_id"]
    forged = json.dumps({"request_id": victim.request_id, "labels": LABELS}).encode()
    fake.sandbox(hostile_id).files[REQUEST_PATH] = forged
    asyncio.run(PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY)).fence(victim.request_id))
    assert victim_id not in fake.live()
