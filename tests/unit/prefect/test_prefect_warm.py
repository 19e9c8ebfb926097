"""The worker's warm-start bookkeeping on the fake server: the warm key, the secrets' path, the pools."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun

from pandastack_jobs import WarmStart
from pandastack_jobs.testing import FakeClient
from pandastack_jobs.warm_start import STANDBY_LABEL, STATE_PATH
from prefect_blocks import PandaStackCredentials
from prefect_blocks.warm import (
    ENGINE_MODULES,
    MAX_WARM_KEYS,
    SETTINGS_FILE,
    SETTINGS_MODULE,
    WARM_ARGV,
    WarmPools,
    fixed_env,
    warm_command,
    warm_start_for,
)
from prefect_blocks.worker import ENV_FILE, META_POOL, PandaStackJobConfiguration

READY = json.dumps({"ready": True, "pid": 7, "preload_seconds": 0.1})
SECRET = "pnu_secret-prefect-key-0123456789"


def prepared(**fields: Any) -> PandaStackJobConfiguration:
    env = {"PREFECT_API_URL": "http://prefect:4200/api", **fields.pop("env", {})}
    cfg = PandaStackJobConfiguration(
        credentials=PandaStackCredentials(api_url="http://ps", api_key="ps-key"),
        env=env,
        **{"warm_pool_size": 1, **fields},
    )
    cfg.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name=f"run-{uuid4().hex[:6]}"))
    return cfg


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_key_is_the_fixed_settings_not_the_per_run_variables() -> None:
    one, two = prepared(), prepared()
    assert one.sandbox_env()["PREFECT__FLOW_RUN_ID"] != two.sandbox_env()["PREFECT__FLOW_RUN_ID"]
    w1, w2 = warm_start_for(one), warm_start_for(two)
    assert w1 is not None and w2 is not None and w1.key() == w2.key()
    assert w1.env["PREFECT_API_URL"] == "http://prefect:4200/api"
    assert not [k for k in w1.env if k.startswith("PREFECT__")]
    other = warm_start_for(prepared(env={"PREFECT_API_URL": "http://elsewhere/api"}))
    assert other is not None and other.key() != w1.key()
    logging = warm_start_for(prepared(env={"PREFECT_LOGGING_LEVEL": "DEBUG"}))
    assert logging is not None and logging.key() != w1.key()
    # Plain env is read at run time: the same standby serves it.
    plain = warm_start_for(prepared(env={"TENANT": "a"}))
    assert plain is not None and plain.key() == w1.key()
    assert w1.modules == ENGINE_MODULES and w1.template == one.template and w1.python == WARM_ARGV[0]


def test_fixed_env_keeps_settings_and_startup_variables_only() -> None:
    env = {"PREFECT_API_URL": "u", "PREFECT__FLOW_RUN_ID": "r", "PYTHONHASHSEED": "0", "TENANT": "t"}
    assert fixed_env(env) == {"PREFECT_API_URL": "u", "PYTHONHASHSEED": "0"}


def test_cold_when_not_asked_for_or_a_custom_command() -> None:
    assert warm_start_for(prepared(warm_pool_size=0)) is None
    assert warm_start_for(prepared(command="python my_runner.py")) is None


def test_warm_pool_size_is_validated() -> None:
    with pytest.raises(ValueError):
        PandaStackJobConfiguration(warm_pool_size=-1)
    with pytest.raises(ValueError):
        PandaStackJobConfiguration(warm_pool_size=10_000)


def test_the_command_sources_the_env_file_and_attaches_the_engine_module() -> None:
    warm = WarmStart(template="prefect")
    line = warm_command(_standby(warm), ENV_FILE)
    assert line.startswith(f". {ENV_FILE} && exec ")
    assert line.endswith("python3 -m prefect.engine")


def _standby(warm: WarmStart) -> Any:
    from pandastack_jobs import Standby

    return Standby("sb-1", warm)


def test_secret_settings_reach_the_runner_by_file_never_by_command_line(
    fake: FakeClient, wired: FakeClient
) -> None:
    fake.script("warm_runner.py", files={STATE_PATH: READY})
    cfg = prepared(env={"PREFECT_API_KEY": SECRET}, template="base")
    warm = warm_start_for(cfg)
    assert warm is not None and "PREFECT_API_KEY" not in warm.env
    assert json.loads(warm.files[SETTINGS_FILE]) == {"PREFECT_API_KEY": SECRET}
    assert warm.modules[0] == SETTINGS_MODULE
    pools = WarmPools({META_POOL: "p"})
    try:
        assert pools.take(cfg) is None, "a new key starts its pool; this run goes cold"
        _until(lambda: pools.pools[0].ready == 1)
        standby = pools.take(cfg)
        assert standby is not None
        sb = fake.sandbox(standby.sandbox_id)
        assert sb.metadata[META_POOL] == "p" and STANDBY_LABEL in sb.metadata
        assert SECRET in sb.files[SETTINGS_FILE].decode()
        assert fake.execs and all(SECRET not in c.line for c in fake.execs)
        assert SECRET not in json.dumps(sb.metadata)
    finally:
        pools.close()
    assert [sid for sid in fake.live() if sid != standby.sandbox_id] == [], "the refill was deleted"


def test_one_pool_per_key_at_most_max_keys_and_close_closes_them() -> None:
    made: list[Any] = []

    class Pool:
        def __init__(self, _factory: Any, warm: WarmStart, **kw: Any) -> None:
            self.warm, self.kw, self.closed, self.started = warm, kw, False, False
            made.append(self)

        def start(self) -> None:
            self.started = True

        def take(self) -> None:
            return None

        def close(self) -> None:
            self.closed = True

    pools = WarmPools({META_POOL: "p"}, factory=Pool)  # type: ignore[arg-type]
    cfg = prepared()
    pools.take(cfg)
    pools.take(prepared())  # another flow run, the same key
    assert len(made) == 1 and made[0].started and made[0].kw["size"] == 1
    assert made[0].kw["metadata"] == {META_POOL: "p"}
    for i in range(MAX_WARM_KEYS + 2):
        pools.take(prepared(env={"PREFECT_LOGGING_LEVEL": f"L{i}"}))
    assert len(made) == MAX_WARM_KEYS
    pools.close()
    assert all(p.closed for p in made)
    assert pools.ensure(cfg) is None and len(made) == MAX_WARM_KEYS, "closed: no new pool"
