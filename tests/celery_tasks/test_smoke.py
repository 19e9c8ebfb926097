from tests.celery_tasks.conftest import Celeryland


def test_echo(celeryland: Celeryland) -> None:
    celeryland.worker()
    r = celeryland.send("echo", {"a": 1})
    assert r.get(timeout=60) == {"x": {"a": 1}, "task_id": r.id, "retries": 0}
