"""What the service checks about chat and preference data before a run: uploads with
purpose chat or preference (POST /v1/files, on a real database and storage folder), and the
chat template a local model folder brings (app/services/rules/model_files.chat_template_of)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.services.rules.model_files import chat_template_of
from app.settings import Settings
from app.storage.models import File

USER = {"role": "user", "content": "What is 2 + 2?"}
ASSISTANT = {"role": "assistant", "content": "4"}
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _jsonl(*records: object) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def _problems(response: Any) -> list[str]:
    body = response.json()
    assert body["error"] == "validation_error", body
    return [p["message"] for p in body["detail"]]


def _stored(session_factory: sessionmaker[Session], settings: Settings) -> tuple[int, list[Path]]:
    with session_factory() as session:
        rows = int(session.scalar(select(func.count()).select_from(File)) or 0)
    folder = settings.uploads_dir
    return rows, sorted(folder.iterdir()) if folder.is_dir() else []


def _upload(client: TestClient, auth: dict[str, str], name: str, data: bytes, **form: str) -> Any:
    return client.post("/v1/files", files={"file": (name, data)}, data=form, headers=auth)


class TestChatUpload:
    def test_a_good_chat_file_is_stored_with_its_record_count(
        self, client: TestClient, auth: dict[str, str], settings: Settings
    ) -> None:
        data = _jsonl(
            {"messages": [USER, ASSISTANT]},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    USER,
                    {**ASSISTANT, "weight": 0},
                    {"role": "user", "content": "And 3 + 3?"},
                    {"role": "assistant", "content": "6", "weight": 1},
                ]
            },
        )
        response = _upload(client, auth, "chats.jsonl", data, purpose="chat")

        assert response.status_code == 201, response.text
        body = response.json()
        assert (body["purpose"], body["records"], body["fields"]) == ("chat", 2, ["messages"])
        fetched = client.get(f"/v1/files/{body['id']}", headers=auth)
        assert fetched.json()["purpose"] == "chat"
        stored = list((settings.uploads_dir).iterdir())
        assert [p.read_bytes() for p in stored] == [data]

    def test_bad_records_are_reported_by_line_and_rule_and_nothing_is_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        data = _jsonl(
            {"messages": [USER, ASSISTANT]},
            {"messages": [USER, ASSISTANT]},
            {"messages": [{"role": "system", "content": "Be brief."}, USER]},
            {"messages": [USER, {"role": "bot", "content": "4"}]},
            {"messages": [{**USER, "weight": 2}, ASSISTANT]},
            {"text": "plain text"},
        )
        response = _upload(client, auth, "chats.jsonl", data, purpose="chat")

        assert response.status_code == 422
        assert _problems(response) == [
            "line 3: 'messages' has no assistant message with weight 1 (absent weight means "
            "1): nothing in the conversation would be learned",
            "line 4: messages[1].role must be one of 'system', 'developer', 'user', "
            "'assistant', got 'bot'",
            "line 5: messages[0].weight is allowed on assistant messages only, not on 'user'",
            "line 6: record has no 'messages' (dataset.messages_field)",
        ]
        assert _stored(session_factory, settings) == (0, [])

    def test_lists_in_the_messages_field_are_not_held_to_the_text_rule(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        # The same file as text data has no `text` field; as chat it is fine.
        data = _jsonl({"messages": [USER, ASSISTANT]})
        assert _upload(client, auth, "c.jsonl", data).status_code == 422
        assert _upload(client, auth, "c.jsonl", data, purpose="chat").status_code == 201

    def test_the_messages_field_is_named_by_the_form(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = _jsonl({"conversation": [USER, ASSISTANT]})
        refused = _upload(client, auth, "c.jsonl", data, purpose="chat")
        assert _problems(refused) == ["line 1: record has no 'messages' (dataset.messages_field)"]
        ok = _upload(client, auth, "c.jsonl", data, purpose="chat", messages_field="conversation")
        assert ok.status_code == 201, ok.text
        assert ok.json()["fields"] == ["conversation"]

    def test_parquet_chat_records_are_checked_row_by_row(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        # Arrow gives every message every key some message has: absent weights read as null.
        table = pa.table(
            {
                "messages": [
                    [USER, {**ASSISTANT, "weight": 1}],
                    [USER, {**ASSISTANT, "weight": 0}],
                    [USER, ASSISTANT],
                ]
            }
        )
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        response = _upload(client, auth, "c.parquet", buffer.getvalue(), purpose="chat")
        assert _problems(response) == [
            "row 2: 'messages' has no assistant message with weight 1 (absent weight means 1): "
            "nothing in the conversation would be learned"
        ]

    def test_csv_cannot_hold_chat_records(self, client: TestClient, auth: dict[str, str]) -> None:
        data = b'messages\n"[{""role"": ""user""}]"\n'
        response = _upload(client, auth, "c.csv", data, purpose="chat")
        assert response.status_code == 422
        assert _problems(response) == [
            "a CSV file cannot hold chat records: its cells are text, not lists of messages; "
            "upload .jsonl or .parquet"
        ]

    def test_the_purposes_are_listed_when_one_is_unknown(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = _jsonl({"messages": [USER, ASSISTANT]})
        response = _upload(client, auth, "c.jsonl", data, purpose="conversation")
        assert response.status_code == 422
        message = response.text
        for purpose in ("chat", "preference", "text", "prompt_completion"):
            assert purpose in message


class TestPreferenceUpload:
    def test_text_and_conversational_pairs_are_stored(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = _jsonl(
            {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
            {
                "prompt": [USER],
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}],
            },
        )
        response = _upload(client, auth, "pairs.jsonl", data, purpose="preference")
        assert response.status_code == 201, response.text
        body = response.json()
        assert (body["purpose"], body["records"]) == ("preference", 2)
        assert body["fields"] == ["prompt", "chosen", "rejected"]

    def test_a_missing_answer_is_reported_by_line_and_nothing_is_stored(
        self,
        client: TestClient,
        auth: dict[str, str],
        settings: Settings,
        session_factory: sessionmaker[Session],
    ) -> None:
        data = _jsonl(
            {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
            {"prompt": "3 + 3 =", "chosen": " 6"},
            {"prompt": [USER, ASSISTANT], "chosen": "4", "rejected": "5"},
        )
        response = _upload(client, auth, "pairs.jsonl", data, purpose="preference")
        assert response.status_code == 422
        assert _problems(response) == [
            "line 2: record has no 'rejected' (dataset.rejected_field)",
            "line 3: prompt[1].role is 'assistant': a prompt given as messages ends with the "
            "user turn that the chosen and rejected answers reply to",
        ]
        assert _stored(session_factory, settings) == (0, [])

    def test_csv_pairs_of_text_with_named_fields(
        self, client: TestClient, auth: dict[str, str]
    ) -> None:
        data = b"q,good,bad\n2 + 2 =, 4, 5\n3 + 3 =, 6,\n"
        form = {"purpose": "preference", "prompt_field": "q", "chosen_field": "good"}
        refused = _upload(client, auth, "p.csv", data, **form)
        assert _problems(refused) == [
            "line 2: record has no 'rejected' (dataset.rejected_field)",
            "line 3: record has no 'rejected' (dataset.rejected_field)",
        ]
        form["rejected_field"] = "bad"
        assert _problems(_upload(client, auth, "p.csv", data, **form)) == ["line 3: 'bad' is empty"]
        ok = _upload(client, auth, "p.csv", data[:-1] + b"7\n", **form)
        assert ok.status_code == 201, ok.text
        assert ok.json()["records"] == 2


class TestChatTemplateOf:
    """Against what transformers itself loads from the same folder."""

    @pytest.fixture(scope="class")
    def tokenizer(self, tmp_path_factory: pytest.TempPathFactory) -> Any:
        from app.cli.tiny_assets import build_tokenizer

        return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))

    @staticmethod
    def loaded(folder: Path) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder).chat_template

    def test_a_template_saved_as_chat_template_jinja(self, tokenizer: Any, tmp_path: Path) -> None:
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(tmp_path)
        assert (tmp_path / "chat_template.jinja").is_file()
        assert chat_template_of(tmp_path) == self.loaded(tmp_path) == CHATML

    def test_a_template_in_tokenizer_config(self, tokenizer: Any, tmp_path: Path) -> None:
        tokenizer.chat_template = CHATML
        tokenizer.save_pretrained(tmp_path, save_jinja_files=False)
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHATML
        assert chat_template_of(tmp_path) == self.loaded(tmp_path) == CHATML

    @pytest.mark.parametrize("jinja_files", [True, False])
    def test_of_several_templates_the_default(
        self, tokenizer: Any, tmp_path: Path, jinja_files: bool
    ) -> None:
        # As files: chat_template.jinja and additional_chat_templates/; or, older, a list
        # of {name, template} in tokenizer_config.json.
        tokenizer.chat_template = {"default": CHATML, "tool_use": "{{ tools }}"}
        tokenizer.save_pretrained(tmp_path, save_jinja_files=jinja_files)
        loaded = self.loaded(tmp_path)
        assert loaded == {"default": CHATML, "tool_use": "{{ tools }}"}
        assert chat_template_of(tmp_path) == loaded["default"]

    def test_no_template(self, tokenizer: Any, tmp_path: Path) -> None:
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path)
        assert chat_template_of(tmp_path) is None
        assert self.loaded(tmp_path) is None

    def test_several_templates_without_a_default_are_none(
        self, tokenizer: Any, tmp_path: Path
    ) -> None:
        tokenizer.chat_template = {"tool_use": "{{ tools }}", "rag": "{{ documents }}"}
        tokenizer.save_pretrained(tmp_path)
        assert chat_template_of(tmp_path) is None
        from transformers import AutoTokenizer

        with pytest.raises(ValueError, match="no default"):
            AutoTokenizer.from_pretrained(tmp_path).get_chat_template()

    def test_template_files_win_over_tokenizer_config(self, tokenizer: Any, tmp_path: Path) -> None:
        tokenizer.chat_template = "{{ 'from the config' }}"
        tokenizer.save_pretrained(tmp_path, save_jinja_files=False)
        (tmp_path / "chat_template.jinja").write_text(CHATML)
        assert chat_template_of(tmp_path) == self.loaded(tmp_path) == CHATML

        # Only named templates as files: the config's template is not read at all.
        (tmp_path / "chat_template.jinja").unlink()
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
        assert self.loaded(tmp_path) == {"tool_use": "{{ tools }}"}
        assert chat_template_of(tmp_path) is None

    def test_a_processor_chat_template_json_is_not_the_tokenizers(
        self, tokenizer: Any, tmp_path: Path
    ) -> None:
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path)
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
        assert self.loaded(tmp_path) is None
        assert chat_template_of(tmp_path) is None

    def test_an_empty_template_is_none(self, tokenizer: Any, tmp_path: Path) -> None:
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path)
        (tmp_path / "chat_template.jinja").write_text("")
        assert not self.loaded(tmp_path)  # the worker's tokenizer has nothing to render with
        assert chat_template_of(tmp_path) is None

    def test_a_model_folder_from_tiny_assets(self, tiny_llama_dir: Path, tmp_path: Path) -> None:
        folder = tmp_path / "model"
        shutil.copytree(tiny_llama_dir, folder)
        assert chat_template_of(folder) == self.loaded(folder)
