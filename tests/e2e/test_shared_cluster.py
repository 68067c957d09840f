"""A team sharing a cluster too small for all its runs: the real service and a real local
Ray cluster of 2 CPUs, two API keys, real DeepSpeed training.

- Priorities and fair share order what starts, and every waiting run says why.
- A key at its quota waits with that reason while another key's run starts.
- A high-priority run preempts a low one, which checkpoints at the step it is on, goes back
  to the queue, resumes from there and succeeds with every step's loss exactly once, equal
  to the same training run uninterrupted.
- Two service replicas on PostgreSQL never start a key's runs past its limit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from app.cli.tiny_assets import write_jsonl_dataset
from tests.conftest import create_postgres_database, drop_postgres_database
from tests.e2e.conftest import Service, make_service
from tests.e2e.helpers import assert_succeeded

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

# The cluster: 2 CPUs. A one-worker run takes half of it, a two-worker run all of it.
CLUSTER_CPUS = 2


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_models_root: Path) -> Iterator[Service]:
    svc = make_service(
        tmp_path_factory.mktemp("shared-home"),
        tmp_path_factory.mktemp("shared-data"),
        [tiny_models_root],
    )
    svc.env.update(
        {
            "TUNEYARD_LOCAL_RAY_NUM_CPUS": str(CLUSTER_CPUS),
            # No minimum run time, and the worker asks often: a test's runs last seconds.
            "TUNEYARD_PREEMPTION_MIN_RUN_S": "0",
            "TUNEYARD_PREEMPTION_POLL_S": "0.5",
        }
    )
    with svc.running():
        yield svc


def _key(svc: Service, name: str, *limits: str) -> httpx.Client:
    secret = subprocess.run(
        [sys.executable, "-m", "app", "keys", "create", "--name", name, *limits],
        env=svc.env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return httpx.Client(
        base_url=svc.base_url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    )


def _body(model: Path, data: Path, *, workers: int, steps: int, **top: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data)},
        "training": {"max_steps": steps, "batch_size_per_worker": 2, "seq_length": 32},
        "deepspeed": {"zero_stage": 2 if workers > 1 else 0},
        "resources": {"num_workers": workers, "cpus_per_worker": 1},
        "checkpointing": {"export_hf": False},
        **top,
    }


def _submit(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/runs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _get(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return dict(client.get(f"/v1/runs/{run_id}").json())


def _reason(client: httpx.Client, run_id: str) -> str:
    """Why the run waits, or "" (it is not queued, or no pass has looked at it yet)."""
    return str((_get(client, run_id)["queue"] or {}).get("reason") or "")


def _until(what: str, check: Callable[[], Any], timeout_s: float = 240) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"not {what} after {timeout_s}s"
        time.sleep(0.25)
    return found


def _terminal(client: httpx.Client, run_id: str) -> dict[str, Any]:
    return dict(
        _until(
            f"{run_id} finished",
            lambda: (
                (r := _get(client, run_id))["status"] in {"succeeded", "failed", "cancelled"} and r
            ),
            timeout_s=600,
        )
    )


def _started_event_id(client: httpx.Client, run_id: str) -> int:
    """The id of the run's first `starting` event: ids are global, so they order claims."""
    events = client.get(f"/v1/runs/{run_id}/events", params={"limit": 1000}).json()["data"]
    return min(e["id"] for e in events if e["type"] == "status" and e["status"] == "starting")


def test_priority_and_fair_share_order_the_queue_and_a_key_at_its_quota_waits(
    shared: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(shared.data_dir / "queue.jsonl", rows=64, seed=3)
    alice = _key(shared, "alice")
    bob = _key(shared, "bob", "--max-running-runs", "1")
    small = _body(tiny_model_dir, data, workers=1, steps=2)

    # Alice's two-worker run takes the whole cluster; everything after it queues. It may
    # not be preempted: the urgent run must wait for it like everyone else.
    blocker = _submit(alice, _body(tiny_model_dir, data, workers=2, steps=12, preemptible=False))
    _until("the blocker running", lambda: _get(alice, blocker)["status"] == "running")
    a1 = _submit(alice, small)
    b1 = _submit(bob, small)
    b2 = _submit(bob, small)
    urgent = _submit(alice, {**small, "priority": 80})

    # Positions as the scheduler will take them: priority first, then the key with fewer
    # runs (Alice's blocker counts for her), then age. First come would be a1 b1 b2 urgent.
    def positions() -> dict[str, int]:
        views = [_get(alice, r) for r in (a1, urgent)] + [_get(bob, r) for r in (b1, b2)]
        return {v["id"]: v["queue"]["position"] for v in views if v["status"] == "queued"}

    assert positions() == {urgent: 1, b1: 2, b2: 3, a1: 4}
    answer = alice.get("/v1/runs", params={"status": "queued"}).json()
    listed = answer["data"]
    assert [r["id"] for r in listed] == [urgent, a1], answer

    # Why each waits: the urgent run for the cluster, the others behind it.
    reason = _until("the urgent run's reason", lambda: _get(alice, urgent)["queue"]["reason"])
    assert reason.startswith("waiting for cluster resources (needs 1 CPU, 0 CPUs free)"), reason
    behind = _get(bob, b1)["queue"]["reason"]
    # Alice's run, as Bob is told of it: by its priority, never its id.
    assert behind.startswith("behind higher priority (another key's run, priority 80"), behind
    assert urgent not in behind

    # Once the blocker is done: the urgent run and Bob's first start together (the two
    # slots of the cluster), ahead of Alice's older runs; Bob's second waits for his quota.
    assert_succeeded(shared, _terminal(alice, blocker))
    quota = _until(
        "Bob's second run waiting for his quota",
        lambda: (
            (r := _get(bob, b2))["status"] == "queued"
            and "waiting for quota" in (r["queue"]["reason"] or "")
            and r["queue"]["reason"]
        ),
    )
    assert quota == "waiting for quota (1 of 1 running, max_running_runs)"
    runs = ((alice, urgent), (bob, b1), (alice, a1), (bob, b2))
    for client, run_id in runs:
        assert_succeeded(shared, _terminal(client, run_id))
    claimed = {run_id: _started_event_id(client, run_id) for client, run_id in runs}
    # Alice's a1 is older than both of Bob's runs, yet Bob's first went before it.
    first_two = sorted(claimed, key=claimed.__getitem__)[:2]
    assert set(first_two) == {urgent, b1}, claimed


def test_a_higher_priority_run_preempts_a_lower_one_which_resumes_without_a_gap(
    shared: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(shared.data_dir / "preempt.jsonl", rows=400, seed=9)
    low_key = _key(shared, "batch")
    high_key = _key(shared, "oncall")
    steps = 30
    # Both train the same thing; only the priority differs. The high one runs without a
    # break, so its losses are what the low one's must be, step for step.
    body = _body(tiny_model_dir, data, workers=2, steps=steps)
    body["training"]["learning_rate"] = 1e-3
    low = _submit(low_key, {**body, "priority": 10})
    # The high run comes as soon as the low one runs: its workers are still loading the
    # model, so the request reaches them well before the last step on a machine of any
    # speed (the last step is never preempted: a run that gets there simply finishes).
    _until("the low run running", lambda: _get(low_key, low)["status"] == "running")
    high = _submit(high_key, {**body, "priority": 90})

    reason = _until(
        "the preemption",
        lambda: "preempting" in (reason := _reason(high_key, high)) and reason,
    )
    assert reason.startswith("waiting for cluster resources (needs 2 CPUs"), reason
    # The two runs are two keys': each is told of the other's by its priority only.
    assert reason.endswith("preempting another key's run"), reason

    def back_in_queue() -> dict[str, Any] | None:
        run = _get(low_key, low)
        assert run["status"] not in {"succeeded", "failed", "cancelled"}, run
        return run if run["status"] == "queued" and run["attempt"] == 2 else None

    requeued = _until("the low run back in the queue", back_in_queue)
    # It says so until it starts again, then why it waits now (the next pass may already
    # have found the high run started, and the cluster full).
    assert requeued["queue"]["reason"].startswith("preempted (resumes from step ")

    assert_succeeded(shared, _terminal(high_key, high))
    done = _terminal(low_key, low)
    assert_succeeded(shared, done)
    assert done["attempt"] == 2

    events = low_key.get(f"/v1/runs/{low}/events", params={"limit": 1000}).json()["data"]
    preempted = [e for e in events if e["type"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["attempt"] == 1, events
    assert "another key's run (priority 90) needs its resources" in preempted[0]["message"]
    assert high not in preempted[0]["message"]
    # Its first attempt was preempting, a status of its own, until it stopped.
    first = [e["status"] for e in events if e["type"] == "status" and e["attempt"] == 1]
    assert first[-2:] == ["running", "preempting"], first
    stopped_at = int(preempted[0]["message"].split("preempted at step ")[1].split(":")[0])
    assert 1 <= stopped_at < steps
    # The checkpoint was taken at the step it stopped: the second attempt's first step is
    # the next one, and every step's loss was logged once, by one attempt or the other.
    losses = low_key.get(f"/v1/runs/{low}/metrics", params={"name": "loss", "limit": 1000}).json()[
        "data"
    ]
    assert sorted(m["step"] for m in losses) == list(range(1, steps + 1))
    assert min(m["step"] for m in losses if m["attempt"] == 2) == stopped_at + 1
    reference = high_key.get(
        f"/v1/runs/{high}/metrics", params={"name": "loss", "limit": 1000}
    ).json()["data"]
    assert {m["step"]: m["value"] for m in losses} == pytest.approx(
        {m["step"]: m["value"] for m in reference}, rel=1e-5
    )


def test_two_replicas_on_postgresql_never_start_past_a_keys_limit(
    shared: Service,
    postgres_url: str,  # PostgreSQL is reachable (else skipped, or failed in CI)
    tiny_models_root: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """Two service processes on one PostgreSQL database dispatch to the same cluster, which
    has room for two one-worker runs at once; the key may have one running. Each replica
    takes half the submissions, and both dispatchers decide on every pass."""
    database = create_postgres_database()
    head = shared.http.get("/healthz").json()["ray"]["address"]
    replicas = []
    for name in ("replica-a", "replica-b"):
        (tmp_path / name).mkdir()
        svc = make_service(
            tmp_path / name, shared.data_dir, [tiny_models_root], database_url=database
        )
        svc.env.update(
            {
                "TUNEYARD_RAY_ADDRESS": head,
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN_PATH": str(shared.home / "ray" / "auth_token"),
                "TUNEYARD_STORAGE_PATH": str(shared.home / "storage"),
            }
        )
        replicas.append(svc)
    engine = create_engine(database)
    try:
        with replicas[0].running(), replicas[1].running():
            clients = [_key(replicas[0], "team", "--max-running-runs", "1")]
            clients.append(
                httpx.Client(base_url=replicas[1].base_url, headers=clients[0].headers, timeout=30)
            )
            data = write_jsonl_dataset(shared.data_dir / "replicas.jsonl", rows=64, seed=4)
            body = _body(tiny_model_dir, data, workers=1, steps=2)
            ids = [_submit(clients[i % 2], body) for i in range(2)]

            most = 0
            live = text("SELECT count(*) FROM runs WHERE status IN ('starting', 'running')")
            deadline = time.monotonic() + 600
            while True:
                with engine.connect() as conn:
                    most = max(most, conn.execute(live).scalar_one())
                    done = conn.execute(
                        text("SELECT count(*) FROM runs WHERE status = 'succeeded'")
                    ).scalar_one()
                if done == len(ids):
                    break
                assert time.monotonic() < deadline, "the runs did not all succeed"
                time.sleep(0.1)
            assert most == 1
            claimed_by = {_get(clients[0], run_id)["ray_submission_id"] for run_id in ids}
            assert len(claimed_by) == len(ids)  # each submitted once
    finally:
        engine.dispose()
        drop_postgres_database(database)
