"""Chat and preference data, DPO and LoRA in the run request: which combinations the service
accepts, the 422s that name the field and the rule with nothing stored, and `model` naming an
earlier run (a DPO run after an SFT run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from tests.app.worker_calls import run_location
from tests.factories import run_request


def _problems(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    r = client.post("/v1/runs/validate", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


def _runs(session_factory: sessionmaker[Session]) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(Run)) or 0)


def _preference_file(root: Path) -> Path:
    path = root / "pairs.jsonl"
    path.write_text(
        json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
        + "\n"
        + json.dumps({"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Rome"})
        + "\n"
    )
    return path


class TestCombinations:
    def test_dpo_needs_preference_data(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path, method={"type": "dpo", "beta": 0.1})
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 422, r.text
        fields = {e["field"]: e["message"] for e in r.json()["detail"]}
        assert "needs dataset.format 'preference'" in fields["method.type"]
        assert _runs(session_factory) == 0

    def test_preference_data_needs_dpo(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path, dataset={"source": str(_preference_file(tmp_path)), "format": "preference"}
        )
        assert "dpo" in _problems(client, auth, body)["dataset.format"]

    def test_a_dpo_run_on_preference_pairs_is_valid(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            dataset={"source": str(_preference_file(tmp_path)), "format": "preference"},
            method={"type": "dpo", "beta": 0.2},
            lora={"r": 4, "alpha": 8},
        )
        assert _problems(client, auth, body) == {}

    def test_dpo_does_not_pack(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            dataset={"source": str(_preference_file(tmp_path)), "format": "preference"},
            method={"type": "dpo"},
            training={"packing": True},
        )
        assert "pair" in _problems(client, auth, body)["training.packing"]

    def test_chat_is_for_causal_lm(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path,
            task="sequence_classification",
            dataset={"format": "chat", "label_field": "label"},
        )
        assert "takes format 'text'" in _problems(client, auth, body)["dataset.format"]

    def test_a_chat_template_needs_chat_data(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(tmp_path, dataset={"chat_template": "{{ messages }}"})
        assert (
            "formats 'chat', 'preference' and 'prompt'"
            in _problems(client, auth, body)["dataset.chat_template"]
        )

    def test_lora_with_autotp_is_refused_with_the_reason(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = run_request(
            tmp_path, lora={"r": 8}, deepspeed={"zero_stage": 1, "tensor_parallel_size": 2}
        )
        assert "AutoTP" in _problems(client, auth, body)["lora"]


def _chat_file(root: Path, *records: Any) -> Path:
    path = root / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD_CHAT = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
}


class TestChatData:
    def test_a_model_without_a_chat_template_is_refused_with_nothing_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(
            tmp_path, dataset={"source": str(_chat_file(tmp_path, GOOD_CHAT)), "format": "chat"}
        )
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 422, r.text
        fields = {e["field"]: e["message"] for e in r.json()["detail"]}
        assert "has none: give dataset.chat_template" in fields["dataset.chat_template"]
        assert _runs(session_factory) == 0

    def test_the_requests_template_or_the_models_own_will_do(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        data = {"source": str(_chat_file(tmp_path, GOOD_CHAT)), "format": "chat"}
        given = run_request(tmp_path, dataset={**data, "chat_template": "{{ messages }}"})
        assert _problems(client, auth, given) == {}
        # As transformers 5 saves a tokenizer's template: chat_template.jinja beside it.
        (tmp_path / "model" / "chat_template.jinja").write_text("{{ messages }}")
        assert _problems(client, auth, run_request(tmp_path, dataset=data)) == {}

    def test_local_records_are_checked_with_their_lines(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        no_assistant = {"messages": [{"role": "user", "content": "Hi"}]}
        odd_role = {"messages": [{"role": "bot", "content": "Hi"}]}
        data = _chat_file(tmp_path, GOOD_CHAT, no_assistant, odd_role)
        body = run_request(
            tmp_path, dataset={"source": str(data), "format": "chat", "chat_template": "{{ 1 }}"}
        )
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 422, r.text
        messages = [e["message"] for e in r.json()["detail"] if e["field"] == "dataset.source"]
        assert len(messages) == 2, messages
        assert "line 2" in messages[0] and "assistant" in messages[0]
        assert "line 3" in messages[1] and "'bot'" in messages[1]
        assert _runs(session_factory) == 0

    def test_preference_records_missing_rejected_are_refused(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        path = tmp_path / "pairs.jsonl"
        path.write_text(json.dumps({"prompt": "2+2?", "chosen": "4"}) + "\n")
        body = run_request(
            tmp_path,
            dataset={"source": str(path), "format": "preference"},
            method={"type": "dpo"},
        )
        message = _problems(client, auth, body)["dataset.source"]
        assert "line 1" in message and "rejected" in message

    def test_preference_prompts_as_messages_need_a_chat_template(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        path = tmp_path / "pairs.jsonl"
        pairs = [
            {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
            {"prompt": [{"role": "user", "content": "3+3?"}], "chosen": "6", "rejected": "7"},
        ]
        path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
        dataset = {"source": str(path), "format": "preference"}
        body = run_request(tmp_path, dataset=dataset, method={"type": "dpo"})
        del body["training"]["seq_length"]  # as a default request leaves it
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 422, r.text
        fields = {e["field"]: e["message"] for e in r.json()["detail"]}
        message = fields["dataset.chat_template"]
        assert message.startswith(
            "line 2 of pairs.jsonl gives its prompt (dataset.prompt_field 'prompt') as chat "
            "messages, which format 'preference' renders with a chat template"
        ), message
        assert _runs(session_factory) == 0
        assert _problems(client, auth, body) == fields
        # Text prompts alone need none.
        path.write_text(json.dumps(pairs[0]) + "\n")
        body["training"]["seq_length"] = 32  # (validate would count the data otherwise)
        assert _problems(client, auth, body) == {}


class TestSchema:
    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"lora": {"r": 0}}, "lora.r"),
            ({"lora": {"r": -4}}, "lora.r"),
            ({"lora": {"alpha": 0}}, "lora.alpha"),
            ({"lora": {"dropout": 1.0}}, "lora.dropout"),
            ({"lora": {"target_modules": []}}, "lora.target_modules"),
            ({"lora": {"target_modules": ["q_proj\n"]}}, "lora.target_modules.list.0"),
            ({"lora": {"target_modules": "all"}}, "lora.target_modules.name"),
            ({"lora": {"export": "gguf"}}, "lora.export"),
            ({"lora": {"rank": 8}}, "lora.rank"),
            ({"method": {"type": "ppo"}}, "method"),
            ({"method": {"type": "dpo", "beta": 0}}, "method.dpo.beta"),
            ({"method": {"type": "sft", "beta": 0.1}}, "method.sft.beta"),
            ({"dataset": {"format": "sharegpt"}}, "dataset.format"),
        ],
    )
    def test_bad_fields_are_422_naming_the_field_with_nothing_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        change: dict[str, Any],
        field: str,
    ) -> None:
        body = run_request(tmp_path, **change)
        r = client.post("/v1/runs", json=body, headers=auth)
        assert r.status_code == 422, r.text
        fields = [e["field"] for e in r.json()["detail"]]
        assert any(f.startswith(field) for f in fields), fields
        assert _runs(session_factory) == 0


class TestModelFromARun:
    def _export(
        self,
        client: TestClient,
        worker: dict[str, str],
        run_id: str,
        path: Path,
        kind: str,
    ) -> None:
        body = {"attempt": 1, "step": 5, "path": str(path), "kind": kind}
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
        assert r.status_code == 200, r.text

    def test_a_run_with_a_full_export_is_the_model(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        export = Path(run_location(settings, run_id, "export"))
        export.mkdir(parents=True)
        (export / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 16}))
        self._export(client, worker, run_id, export / "adapter", "adapter")
        self._export(client, worker, run_id, export, "hf")

        body = run_request(tmp_path, model=run_id)
        # The export's own config is read: its 16 positions are too few for seq_length 32.
        assert "maximum positions (16)" in _problems(client, auth, body)["training.seq_length"]
        body["training"]["seq_length"] = 16
        created = client.post("/v1/runs", json=body, headers=auth)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["model"] == str(export)

    def test_an_export_with_a_link_leading_out_of_it_is_never_the_model(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        """Another run's files reached through a link in this run's export: refused when
        the export is recorded, and when a run starts from it (a link added later)."""
        run_id, worker = started
        elsewhere = tmp_path / "another-runs-export"
        elsewhere.mkdir()
        (elsewhere / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        linked = Path(run_location(settings, run_id, "linked"))
        linked.mkdir(parents=True)
        (linked / "config.json").symlink_to(elsewhere / "config.json")
        body = {"attempt": 1, "step": 5, "path": str(linked), "kind": "hf"}
        r = client.post(f"/v1/internal/runs/{run_id}/checkpoints", json=body, headers=worker)
        assert r.status_code == 422, r.text
        assert "'config.json' in it leads outside the exported folder" in r.text

        export = Path(run_location(settings, run_id, "export"))
        export.mkdir(parents=True)
        (export / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 16}))
        self._export(client, worker, run_id, export, "hf")
        (export / "model.safetensors").symlink_to(elsewhere / "config.json")
        body = run_request(tmp_path, model=run_id, training={"seq_length": 16})
        problem = _problems(client, auth, body)["model"]
        assert problem == (
            f"run {run_id}'s export: 'model.safetensors' in it leads outside the exported folder"
        )

    def test_a_run_with_only_an_adapter_is_refused_with_the_reason(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        self._export(
            client, worker, run_id, Path(run_location(settings, run_id, "export")), "adapter"
        )
        message = _problems(client, auth, run_request(tmp_path, model=run_id))["model"]
        assert "only a LoRA adapter" in message and "'merged' or 'both'" in message

    def test_a_run_without_an_export_or_of_another_owner_is_refused(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        started: tuple[str, dict[str, str]],
        session_factory: sessionmaker[Session],
    ) -> None:
        run_id, _ = started
        assert (
            "has no exported model"
            in _problems(client, auth, run_request(tmp_path, model=run_id))["model"]
        )
        from tests.conftest import make_api_key

        other = {"Authorization": f"Bearer {make_api_key(session_factory, 'team-b')}"}
        assert _problems(client, other, run_request(tmp_path, model=run_id))["model"] == (
            f"no run {run_id!r}"
        )


class TestLoraTargets:
    def test_target_modules_the_model_lacks_are_refused_naming_its_layers(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        body = run_request(tmp_path, model=str(tiny_model_dir), lora={"target_modules": ["q_proj"]})
        message = _problems(client, auth, body)["lora.target_modules"]
        assert "name no linear layer" in message and "c_attn" in message
        body["lora"]["target_modules"] = ["c_attn"]
        assert _problems(client, auth, body) == {}

    def test_validate_counts_only_the_adapters_as_trainable(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        full = run_request(tmp_path, model=str(tiny_model_dir))
        lora = {**full, "lora": {"r": 4, "target_modules": ["c_attn"]}}
        estimates = []
        for body in (full, lora):
            r = client.post("/v1/runs/validate", json=body, headers=auth)
            assert r.status_code == 200 and r.json()["valid"], r.text
            estimates.append(r.json()["estimate"])
        whole, adapted = estimates
        assert whole["trainable_parameters"] == whole["parameters"]
        assert adapted["parameters"] == whole["parameters"]
        assert 0 < adapted["trainable_parameters"] < whole["parameters"] // 10
        lines = adapted["memory_per_worker"]["lines"]
        assert (
            lines["optimizer_states"]["host"]
            < whole["memory_per_worker"]["lines"]["optimizer_states"]["host"] // 10
        )
