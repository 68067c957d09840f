"""Early stopping and the best checkpoint, as the service checks the request and keeps the
result of what the worker reports (on a real database, without Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.worker_calls import run_location, worker_headers
from tests.factories import run_request

EVAL = {"split": "train[:90%]", "eval_split": "train[90%:]"}


def watched(root: Path, **overrides: Any) -> dict[str, Any]:
    return run_request(
        root,
        dataset=EVAL,
        training={"max_steps": 10, "eval_every_n_steps": 2},
        **overrides,
    )


def start(
    client: TestClient,
    auth: dict[str, str],
    body: dict[str, Any],
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> tuple[str, dict[str, str]]:
    r = client.post("/v1/runs", json=body, headers=auth)
    assert r.status_code == 201, r.text
    ray = dispatch_to(ScriptedRay(), settings, session_factory)
    return r.json()["id"], worker_headers(ray)


def post_checkpoint(
    client: TestClient,
    settings: Settings,
    run_id: str,
    worker: dict[str, str],
    step: int,
    **metrics: float | str,
) -> None:
    body = {
        "attempt": 1,
        "step": step,
        "path": run_location(settings, run_id, f"checkpoint_step_{step:08d}"),
        "kind": "deepspeed",
        "metrics": metrics,
    }
    r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
    assert r.status_code == 200, r.text


def problems(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    r = client.post("/v1/runs/validate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


class TestRules:
    @pytest.fixture
    def database_url(self, sqlite_url: str) -> str:
        """SQLite only: these rules are the request's, checked before anything is stored, so
        PostgreSQL would run them again for nothing (tests/app/test_validate_api.py runs
        /validate on both; TestRefused below checks, on both, that nothing is stored)."""
        return sqlite_url

    def test_a_watched_request_is_valid(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = watched(
            tmp_path,
            early_stopping={"metric": "eval_loss", "patience": 2},
            checkpointing={"every_n_steps": 4, "keep_last": 1},
            export={"from": "best"},
        )
        assert problems(client, auth, body) == {}

    @pytest.mark.parametrize(
        ("overrides", "field", "words"),
        [
            ({"early_stopping": {"patience": 0}}, "early_stopping.patience", "greater than"),
            ({"early_stopping": {"min_delta": -1}}, "early_stopping.min_delta", "greater than"),
            ({"early_stopping": {"mode": "up"}}, "early_stopping.mode", "'min' or 'max'"),
            (
                {"early_stopping": {"metric": "eval_accuracy"}},
                "early_stopping.metric",
                "not an evaluation metric of task causal_lm: one of eval_loss, eval_perplexity",
            ),
            (
                {"checkpointing": {"best_metric": "eval_f1"}},
                "checkpointing.best_metric",
                "not an evaluation metric",
            ),
            (
                {"checkpointing": {"best_metric": "eval_loss", "every_n_steps": 3}},
                "checkpointing.every_n_steps",
                "multiple of training.eval_every_n_steps (2)",
            ),
            (
                {"export": {"from": "best"}, "checkpointing": {"export_hf": False}},
                "export.from",
                "needs checkpointing.export_hf",
            ),
            ({"export": {"from": "first"}}, "export.from", "'best' or 'last'"),
        ],
    )
    def test_bad_input_names_the_field(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        overrides: dict[str, Any],
        field: str,
        words: str,
    ) -> None:
        found = problems(client, auth, watched(tmp_path, **overrides))
        assert field in found, found
        assert words in found[field]

    def test_early_stopping_needs_evaluations(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, early_stopping={"patience": 2})
        found = problems(client, auth, body)
        assert "needs evaluations: set dataset.eval_split" in found["early_stopping"]

        body = run_request(tmp_path, dataset=EVAL, early_stopping={"patience": 2})
        found = problems(client, auth, body)
        assert "needs training.eval_every_n_steps" in found["early_stopping"]

    def test_dpo_ranks_by_reward_accuracy(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = watched(tmp_path, early_stopping={"metric": "eval_rewards/accuracies"})
        body["method"] = {"type": "dpo"}
        # Only the metric's rule is asked about here (the data is not preference records).
        assert "early_stopping.metric" not in problems(client, auth, body)


class TestRefused:
    def test_nothing_is_stored_for_a_refused_request(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, early_stopping={"patience": 2})
        assert client.post("/v1/runs", json=body, headers=auth).status_code == 422
        assert client.get("/v1/runs", headers=auth).json()["data"] == []


class TestResult:
    def test_best_checkpoint_follows_the_metric_and_is_kept(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = watched(tmp_path, early_stopping={"patience": 2}, checkpointing={"keep_last": 1})
        run_id, worker = start(client, auth, body, settings, session_factory)
        # eval_loss by step: the best is step 4; step 8 ties it and, being later, takes it
        # (as Ray Train ranks ties); step 10 is the latest.
        for step, loss in ((2, 3.0), (4, 2.0), (6, 2.5), (8, 2.0), (10, "NaN")):
            post_checkpoint(client, settings, run_id, worker, step, eval_loss=loss, loss=1.0)

        listed = client.get(f"/v1/runs/{run_id}/checkpoints", headers=auth).json()["data"]
        flags = {c["step"]: (c["best"], c["pruned"]) for c in listed}
        # keep_last 1: Ray keeps the best by eval_loss and the latest, deletes the rest.
        assert flags == {
            2: (False, True),
            4: (False, True),
            6: (False, True),
            8: (True, False),
            10: (False, False),
        }
        result = client.get(f"/v1/runs/{run_id}", headers=auth).json()["result"]
        assert result["best_step"] == 8
        assert result["best_value"] == 2.0
        assert (result["best_metric"], result["best_mode"]) == ("eval_loss", "min")
        assert result["stop_reason"] is None  # still running

    def test_early_stop_then_success_is_the_stop_reason(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = watched(tmp_path, early_stopping={"patience": 1})
        run_id, worker = start(client, auth, body, settings, session_factory)
        message = "early stopping at step 4: eval_loss did not improve"
        r = client.post(
            f"/v1/internal/runs/{run_id}/events",
            json={"attempt": 1, "type": "early_stopped", "message": message},
            headers=worker,
        )
        assert r.status_code == 200, r.text
        for status in ("running", "succeeded"):
            client.post(
                f"/v1/internal/runs/{run_id}/status",
                json={"attempt": 1, "status": status},
                headers=worker,
            )

        run = client.get(f"/v1/runs/{run_id}", headers=auth).json()
        assert run["status"] == "succeeded"
        assert run["result"]["stop_reason"] == "early_stopping"
        assert run["result"]["stop_message"] == message
        events = client.get(f"/v1/runs/{run_id}/events", headers=auth).json()["data"]
        assert any(e["type"] == "early_stopped" for e in events)

    def test_a_run_that_trains_every_step_completed(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, worker = start(client, auth, run_request(tmp_path), settings, session_factory)
        for status in ("running", "succeeded"):
            client.post(
                f"/v1/internal/runs/{run_id}/status",
                json={"attempt": 1, "status": status},
                headers=worker,
            )
        result = client.get(f"/v1/runs/{run_id}", headers=auth).json()["result"]
        assert result["stop_reason"] == "completed"
        assert result["best_step"] is None
