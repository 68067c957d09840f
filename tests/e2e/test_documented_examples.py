"""Every run request the documentation shows runs as written, end to end, on tiny local
models: the README's CLI tour (`run.yaml`, through the `tuneyard` CLI), its curl body, the
JSON requests under "Training requests", its OpenAI SDK snippet (through the real `openai`
package), and every OpenAPI example in contract/examples.py.

The examples are read from the documents themselves, so a new one is tested by being
written. Only what cannot exist here changes, each change named in `localize`:
- `model`: a tiny local model of the same family (GPT-2, Llama for Qwen and Llama, BERT)
  with at least the documented seq_length's positions; `run_...`: the run of the example
  the document shows just before it (the README's DPO starts from its chat LoRA run);
- the data: a local JSONL of the request's format and fields, written here with enough
  rows (or tokens, when packed) for the documented batch; `file_...`: that file uploaded
  with POST /v1/files; hub-only `split` names and `config` dropped; a hub `eval_split`
  becomes a slice of the single split a local file has;
- `training.max_steps`: 2 (it wins over `epochs`), and `warmup_steps` 1 where the
  documented warmup is longer than that (the service refuses warmup past max_steps);
- `resources`: no GPU, and as many workers as 2 cores hold, keeping tensor parallelism's
  2D layout (tensor 2 x data 2 as 4 workers of half a CPU each).
Everything else (seq_length, precision, packing, gradient checkpointing, LoRA, schedules,
checkpointing, metadata) is as documented, and checked to be so in the stored run.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from contract.examples import RUN_REQUEST_EXAMPLES
from contract.run_request import RunRequest
from tests.e2e.conftest import Service
from tests.e2e.helpers import (
    assert_adapter_loads,
    assert_export_matches_engine,
    assert_succeeded,
    chat_records,
    checkpoints,
    metric_series,
    preference_records,
    prompt_records,
    rft_records,
    tiny_chat_llama,
    write_jsonl,
)

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"
STEPS = 2
CORES = 2  # what this project's machines (and CI's) have
WAIT_S = 840  # within pytest's per-test timeout (pyproject: 900 s)


# -- the examples, as the documents write them ------------------------------------------------


@dataclass(frozen=True)
class Example:
    id: str  # where it is written: the test's id
    body: dict[str, Any]  # the request, as documented
    via: Literal["cli", "http"]  # `tuneyard submit` for a spec file, else POST /v1/runs
    refers_to: str | None = None  # the example a `run_...` model names


@dataclass(frozen=True)
class SdkSnippet:
    id: str
    code: str


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _fenced_blocks(text: str) -> Iterator[tuple[str, str, str]]:
    """(the heading above it, language, code) of each fenced block, in document order."""
    headings = [(m.start(), m.group(1)) for m in re.finditer(r"^#{1,4} (.+)$", text, re.M)]
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        above = [h for pos, h in headings if pos < block.start()]
        yield (above[-1] if above else "top"), block.group(1), block.group(2)


def readme_examples(text: str) -> tuple[list[Example], list[SdkSnippet]]:
    examples: list[Example] = []
    snippets: list[SdkSnippet] = []
    for heading, lang, code in _fenced_blocks(text):
        where = f"readme-{_slug(heading)}"
        if lang == "bash":
            # A spec file written with a heredoc, for the CLI.
            for m in re.finditer(r"cat > (\S+\.ya?ml) <<'?(\w+)'?\n(.*?)\n\2\n", code, re.S):
                examples.append(Example(f"{where}-{m.group(1)}", yaml.safe_load(m.group(3)), "cli"))
            # A body POSTed to /v1/runs; one written another way is not silently left out.
            bodies = re.findall(r"POST \S*/v1/runs\s.*?-d '(\{.*?\})'", code, re.S)
            if len(bodies) != len(re.findall(r"POST \S*/v1/runs\s", code)):
                pytest.fail(f"README, {heading!r}: a POST /v1/runs whose body is not -d '{{...}}'")
            for i, body in enumerate(bodies, start=1):
                examples.append(Example(f"{where}-curl-{i}", json.loads(body), "http"))
        elif lang == "json":
            body = json.loads(code)
            if isinstance(body, dict) and "model" in body:
                n = sum(e.id.startswith(f"{where}-json") for e in examples) + 1
                examples.append(Example(f"{where}-json-{n}", body, "http"))
        elif lang == "python" and "fine_tuning.jobs.create" in code:
            snippets.append(SdkSnippet(f"{where}-sdk", code))
    return _with_references(examples), snippets


def contract_examples() -> list[Example]:
    return _with_references(
        [
            Example(f"contract-{name}", example["value"], "http")
            for name, example in RUN_REQUEST_EXAMPLES.items()
        ]
    )


def _with_references(examples: list[Example]) -> list[Example]:
    """A `run_...` model names an earlier run: the example the document shows just before
    it (the README: "Chat SFT with LoRA ..., then DPO from its merged export")."""
    out: list[Example] = []
    for i, ex in enumerate(examples):
        if str(ex.body["model"]).startswith("run_"):
            if i == 0:
                pytest.fail(
                    f"{ex.id}: model {ex.body['model']!r} names a run, but no example before it"
                )
            ex = Example(ex.id, ex.body, ex.via, refers_to=examples[i - 1].id)
        out.append(ex)
    return out


README_EXAMPLES, SDK_SNIPPETS = readme_examples(README.read_text())
EXAMPLES = README_EXAMPLES + contract_examples()
# Submission (and test) order: runs another example starts from go first, runs that start
# from another's export last, so the queue never waits on the test.
_REFERENCED = {e.refers_to for e in EXAMPLES if e.refers_to}
ORDER = sorted(EXAMPLES, key=lambda e: (e.refers_to is not None, e.id not in _REFERENCED))


def test_the_documents_examples_are_all_found() -> None:
    """The parsing above cannot silently find nothing: every kind the README shows is
    there, and every example the OpenAPI schema offers is one that runs below."""
    ids = [e.id for e in README_EXAMPLES]
    assert any(e.via == "cli" for e in README_EXAMPLES), ids
    assert any("-curl-" in i for i in ids), ids
    assert sum("training-requests-json" in i for i in ids) >= 2, ids
    # Fine-tuning on chat data, and reinforcement fine-tuning with a grader.
    assert len(SDK_SNIPPETS) == 2, [s.id for s in SDK_SNIPPETS]
    assert sum('"reinforcement"' in s.code for s in SDK_SNIPPETS) == 1
    assert len({e.id for e in EXAMPLES}) == len(EXAMPLES)
    offered = [e["value"] for e in RUN_REQUEST_EXAMPLES.values()]
    assert all(s in offered for s in RunRequest.model_json_schema()["examples"])


# -- mapping an example onto this machine -----------------------------------------------------


@dataclass
class Assets:
    """The tiny models and the data the examples run on, built on demand."""

    service: Service
    models_root: Path
    gpt2: Path  # the session's tiny GPT-2 (128 positions)
    bert: Path  # the session's tiny BERT (128 positions)
    built: dict[tuple[str, int], Path] = field(default_factory=dict)

    def model_for(self, example_id: str, name: str, *, positions: int) -> Path:
        lowered = name.lower()
        if "gpt2" in lowered:
            if positions <= 128:
                return self.gpt2
            return self._build("gpt2", max(1024, positions))
        if "qwen" in lowered or "llama" in lowered:
            # Instruct and base Qwen tokenizers alike carry a chat template.
            return tiny_chat_llama(self.models_root, max_positions=max(2048, positions))
        if "bert" in lowered:
            if positions <= 128:
                return self.bert
            return self._build("bert", max(512, positions))
        pytest.fail(f"{example_id}: no tiny model of the family of {name!r}; add one here")

    def _build(self, family: str, positions: int) -> Path:
        from app.cli.tiny_assets import build_tiny_bert, build_tiny_gpt2

        key = (family, positions)
        if key not in self.built:
            folder = self.models_root / f"{family}-{positions}"
            if family == "gpt2":
                self.built[key] = build_tiny_gpt2(folder, n_positions=positions)
            else:
                self.built[key] = build_tiny_bert(folder, max_positions=positions)
        return self.built[key]


def _records(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """`n` records of the request's format, with the field names it reads."""
    from app.cli.tiny_assets import news_lines

    ds = body["dataset"]
    lines = news_lines(2 * n, seed=7)
    if body.get("task") == "sequence_classification":
        records = []
        for i in range(n):
            same = i % 2 == 0
            record = {ds.get("text_field", "text"): lines[2 * i], ds["label_field"]: int(same)}
            if ds.get("text_pair_field"):
                record[ds["text_pair_field"]] = lines[2 * i] if same else lines[2 * i + 1]
            records.append(record)
        return records
    fmt = ds.get("format", "text")
    if fmt == "chat":
        field_name = ds.get("messages_field", "messages")
        return [{field_name: r["messages"]} for r in chat_records(n)]
    if fmt == "preference":
        records = preference_records(
            n,
            prompt_field=ds.get("prompt_field", "prompt"),
            # A hub's pairs (orca_dpo_pairs: `question`) are plain text; an uploaded file
            # is written as OpenAI's DPO format, prompts as messages.
            chat_prompts=str(ds["source"]).startswith("file_"),
        )
        renames = {
            "chosen": ds.get("chosen_field", "chosen"),
            "rejected": ds.get("rejected_field", "rejected"),
        }
        return [{renames.get(k, k): v for k, v in r.items()} for r in records]
    if fmt == "prompt":
        return _prompt_records(body, n)
    if fmt == "prompt_completion":
        return [
            {
                ds.get("prompt_field", "prompt"): line.split(" in ")[0],
                ds.get("completion_field", "completion"): " in " + line.split(" in ", 1)[-1],
            }
            for line in lines[:n]
        ]
    return [{ds.get("text_field", "text"): line} for line in lines[:n]]


def _prompt_records(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """GRPO prompts (chat messages, as OpenAI's RFT data), with every field the grader
    reads as {{item.<field>}} (nested where its name is dotted)."""
    from pydantic import TypeAdapter

    from contract.graders.models import Grader

    grader = TypeAdapter(Grader).validate_python(body["method"]["grader"])
    records = []
    for r in prompt_records(n):
        record: dict[str, Any] = {body["dataset"].get("prompt_field", "prompt"): r["prompt"]}
        for dotted in sorted(grader.item_fields()):
            *parents, leaf = dotted.split(".")
            where = record
            for key in parents:
                where = where.setdefault(key, {})
            where[leaf] = r["answer"]
        records.append(record)
    return records


def _tokens(model: Path, body: dict[str, Any], records: list[dict[str, Any]]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    total = 0
    for record in records:
        if body["dataset"].get("format") == "chat":
            messages = record[body["dataset"].get("messages_field", "messages")]
            total += len(
                tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
        else:
            total += sum(len(tokenizer(str(v))["input_ids"]) for v in record.values())
    return total


def _write_data(body: dict[str, Any], model: Path, path: Path) -> Path:
    """Two optimizer steps' worth of data for the documented batch (so `max_steps` trains
    within one epoch), and a tenth more for an evaluation slice."""
    tr = body.get("training", {})
    res = body.get("resources", {})
    dp = res.get("num_workers", 2) // body.get("deepspeed", {}).get("tensor_parallel_size", 1)
    rows_per_step = (
        tr.get("batch_size_per_worker", 1) * dp * tr.get("gradient_accumulation_steps", 1)
    )
    n = math.ceil(2 * rows_per_step / 0.9) + 2
    records = _records(body, n)
    if tr.get("packing"):
        # Packed rows are seq_length tokens each: enough records for 2 steps of blocks.
        per_record = _tokens(model, body, records) / len(records)
        n = math.ceil(2.5 * rows_per_step * tr["seq_length"] / per_record / 0.9)
        records = _records(body, n)
    return write_jsonl(path, records)


def _upload(service: Service, body: dict[str, Any], path: Path) -> str:
    from contract.datasets import purpose_of

    ds = body["dataset"]
    form = {
        "purpose": purpose_of(body.get("task", "causal_lm"), ds.get("format", "text")),
        **{k: v for k, v in ds.items() if k.endswith("_field") and v},
    }
    with path.open("rb") as f:
        response = service.http.post("/v1/files", files={"file": (path.name, f)}, data=form)
    assert response.status_code in (200, 201), response.text
    file_id: str = response.json()["id"]
    return file_id


# The splits a local file has: "train", and slices of it ("train[:90%]").
_LOCAL_SPLIT = re.compile(r"train(\[[^\]]*\])?")


def localize(
    ex: Example, assets: Assets, *, earlier_runs: dict[str, str]
) -> tuple[dict[str, Any], set[str]]:
    """The example as it runs here, and the dotted paths of what changed (see the module's
    docstring for why each may)."""
    body = copy.deepcopy(ex.body)
    changed: set[str] = {"model", "dataset.source", "training.max_steps"}
    tr = body.setdefault("training", {})
    ds = body["dataset"]

    # Resources first: the data is sized for the workers that run it.
    res = body.get("resources")
    if res is not None:
        if "use_gpu" in res:
            res["use_gpu"] = False
            changed.add("resources.use_gpu")
        if res.pop("gpus_per_worker", None) is not None:
            changed.add("resources.gpus_per_worker")
        tp = body.get("deepspeed", {}).get("tensor_parallel_size", 1)
        workers = res.get("num_workers", 2)
        # Tensor parallelism keeps its tensor x data layout, with 2 data-parallel replicas
        # at most; without it, one worker per core.
        fits = min(workers, 2 * tp) if tp > 1 else min(workers, CORES)
        if fits != workers:
            res["num_workers"] = fits
            changed.add("resources.num_workers")
        if fits * res.get("cpus_per_worker", 1) > CORES:
            res["cpus_per_worker"] = CORES / fits
            changed.add("resources.cpus_per_worker")

    if ex.refers_to:
        body["model"] = earlier_runs[ex.refers_to]
        model = None
    else:
        positions = tr.get("seq_length") or 128
        model = assets.model_for(ex.id, body["model"], positions=positions)
        body["model"] = str(model)

    source = str(ds["source"])
    data = assets.service.data_dir / f"{ex.id}.jsonl"
    _write_data(body, model or Path(_export_of(assets.service, body["model"])), data)
    ds["source"] = _upload(assets.service, body, data) if source.startswith("file_") else str(data)

    # A local or uploaded file is the single split "train" (contract/datasets.py): a hub's
    # named splits become "train", and a hub's separate evaluation split becomes a slice
    # of the file, the training split the rest of it.
    if ds.pop("config", None) is not None:
        changed.add("dataset.config")
    if not _LOCAL_SPLIT.fullmatch(ds.get("split", "train")):
        ds.pop("split")
        changed.add("dataset.split")
    if ds.get("eval_split") and not _LOCAL_SPLIT.fullmatch(ds["eval_split"]):
        ds["split"], ds["eval_split"] = "train[:90%]", "train[90%:]"
        changed |= {"dataset.split", "dataset.eval_split"}

    tr["max_steps"] = STEPS
    # Follows from max_steps: warmup longer than the run is refused (run_rules), so a
    # documented warmup keeps one step of it, and with it the warmup's code path.
    if tr.get("warmup_steps", 0) > STEPS:
        tr["warmup_steps"] = 1
        changed.add("training.warmup_steps")
    return body, changed


def _export_of(service: Service, run_id: str) -> str:
    run = service.http.get(f"/v1/runs/{run_id}").json()
    path: str = run["output"]["model_path"]
    return path


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            # An empty group (`"lora": {}`) asks for its defaults: nothing to compare.
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# -- submitting them all up front -------------------------------------------------------------


@dataclass
class Submitted:
    run_id: str
    body: dict[str, Any]
    changed: set[str]


def _submit(service: Service, ex: Example, body: dict[str, Any]) -> str:
    if ex.via == "cli":
        spec = service.data_dir / f"{ex.id}.yaml"
        spec.write_text(yaml.safe_dump(body, sort_keys=False))
        done = service.cli("submit", str(spec), "--json")
        assert done.returncode == 0, (ex.id, done.stdout, done.stderr)
        run_id: str = json.loads(done.stdout)["id"]
        return run_id
    return service.submit(body)["id"]


@dataclass
class SdkJob:
    namespace: dict[str, Any]
    follow: ast.Module  # the snippet's statements after `jobs.create`
    model: Path  # the tiny model that stands for the snippet's
    hyperparameters: dict[str, Any]  # as the snippet writes them
    extension: dict[str, Any]  # its `extra_body["tuneyard"]`
    metadata: dict[str, str]


@pytest.fixture(scope="module")
def submitted(
    service: Service, tiny_models_root: Path, tiny_model_dir: Path, tiny_bert_dir: Path
) -> tuple[dict[str, Submitted], dict[str, SdkJob]]:
    assets = Assets(service, tiny_models_root, gpt2=tiny_model_dir, bert=tiny_bert_dir)
    runs: dict[str, Submitted] = {}
    earlier: dict[str, str] = {}

    def submit(ex: Example) -> None:
        # A request documented twice (the README's spec file and its curl body; its chat
        # example and the OpenAPI one) runs once: each example's assertions hold its run.
        twin = next((runs[e.id] for e in ORDER if e.id in runs and e.body == ex.body), None)
        if twin is None:
            body, changed = localize(ex, assets, earlier_runs=earlier)
            twin = Submitted(_submit(service, ex, body), body, changed)
        runs[ex.id] = twin
        earlier[ex.id] = twin.run_id

    for ex in ORDER:
        if ex.refers_to is None:
            submit(ex)
    sdk = {s.id: _start_sdk_snippet(s, service, assets) for s in SDK_SNIPPETS}
    for ex in ORDER:
        if ex.refers_to is not None:
            base = service.wait_terminal(earlier[ex.refers_to], timeout_s=WAIT_S)
            assert_succeeded(service, base)
            submit(ex)
    return runs, sdk


# -- the runs ---------------------------------------------------------------------------------


def _assert_export_loads(service: Service, run: dict[str, Any], body: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = (
        AutoModelForSequenceClassification
        if body.get("task") == "sequence_classification"
        else AutoModelForCausalLM
    )
    model_path = Path(run["output"]["model_path"])
    assert model_path.is_dir(), run["output"]
    lora_export = (body.get("lora") or {}).get("export", "adapter") if "lora" in body else None
    if lora_export in ("adapter", "both"):
        (adapter,) = checkpoints(service, run["id"], "adapter")
        base = body["model"] if Path(body["model"]).is_dir() else run["spec"]["model"]
        assert_adapter_loads(Path(adapter["path"]), base, auto=auto)
    if lora_export != "adapter":
        (full,) = checkpoints(service, run["id"], "hf")
        assert Path(full["path"]) == model_path
        model = auto.from_pretrained(model_path)
        assert not any("lora" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("example", ORDER, ids=[e.id for e in ORDER])
def test_documented_example_runs_as_written(
    example: Example,
    service: Service,
    submitted: tuple[dict[str, Submitted], dict[str, SdkJob]],
) -> None:
    sub = submitted[0][example.id]
    run = service.wait_terminal(sub.run_id, timeout_s=WAIT_S)
    assert_succeeded(service, run)

    # What ran is what the document says, but for the changes localize names.
    stored = _leaves({**run["spec"], "metadata": run["metadata"]})
    for path, value in _leaves(example.body).items():
        if path not in sub.changed:
            assert stored.get(path) == value, (path, value, stored.get(path))
    assert run["spec"]["training"]["max_steps"] == STEPS
    if example.refers_to:
        # It started from the earlier example's exported (merged) model.
        earlier = submitted[0][example.refers_to].run_id
        assert run["spec"]["model"] == _export_of(service, earlier), run["spec"]["model"]

    _assert_export_loads(service, run, sub.body)
    if sub.body.get("task") == "sequence_classification" and sub.body["dataset"].get("eval_split"):
        _assert_classification_evaluated(service, run)


def _assert_classification_evaluated(service: Service, run: dict[str, Any]) -> None:
    """A classifier with an evaluation split reports accuracy and F1 (at the end, with no
    eval_every_n_steps), and its export gives the engine's logits under its own head."""
    from transformers import AutoModelForSequenceClassification

    run_id = run["id"]
    for name in ("eval_accuracy", "eval_f1"):
        series = metric_series(service, run_id, name)
        assert list(series) == [STEPS] and 0.0 <= series[STEPS] <= 1.0, (name, series)
    model = assert_export_matches_engine(run, auto=AutoModelForSequenceClassification)
    assert model.config.id2label == {0: "0", 1: "1"}
    config = json.loads((Path(run["output"]["model_path"]) / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]


# -- the OpenAI SDK snippet -------------------------------------------------------------------


def _creates_job(node: ast.AST) -> ast.Call | None:
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith(
            "fine_tuning.jobs.create"
        ):
            return call
    return None


class _RunsHere(ast.NodeTransformer):
    """The snippet with its model, its file's name, the service's address and use_gpu
    changed: nothing else."""

    def __init__(self, *, model: str, files: dict[str, str], base_url: str) -> None:
        self.model, self.files, self.base_url = model, files, base_url

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        func = ast.unparse(node.func)
        if func == "open":
            node.args[0] = ast.Constant(self.files[ast.literal_eval(node.args[0])])
        for kw in node.keywords:
            if func == "OpenAI" and kw.arg == "base_url":
                kw.value = ast.Constant(self.base_url)
            if func.endswith("fine_tuning.jobs.create") and kw.arg == "model":
                kw.value = ast.Constant(self.model)
        return node

    def visit_Dict(self, node: ast.Dict) -> ast.Dict:
        self.generic_visit(node)
        for i, key in enumerate(node.keys):
            if isinstance(key, ast.Constant) and key.value == "use_gpu":
                node.values[i] = ast.Constant(False)
        return node


def _hyperparameters(create: ast.Call) -> dict[str, Any]:
    """The job's `hyperparameters`, as a keyword of `jobs.create` or inside its `method`."""
    for kw in create.keywords:
        if kw.arg == "hyperparameters":
            found: dict[str, Any] = ast.literal_eval(kw.value)
            return found
    for node in ast.walk(create):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "hyperparameters":
                    found = ast.literal_eval(value)
                    return found
    return {}


def _start_sdk_snippet(snippet: SdkSnippet, service: Service, assets: Assets) -> SdkJob:
    """Runs the snippet up to and including `jobs.create`; the rest runs once the job is
    done (its lines read the job's state: run now, they would see it queued)."""
    tree = ast.parse(snippet.code)
    create = _creates_job(tree)
    assert create is not None
    kwargs = {kw.arg: kw.value for kw in create.keywords}
    documented_model = ast.literal_eval(kwargs["model"])
    hyper = _hyperparameters(create)
    extension = ast.literal_eval(kwargs["extra_body"])["tuneyard"]
    model = assets.model_for(snippet.id, documented_model, positions=128)

    files: dict[str, str] = {}
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "open":
            name = ast.literal_eval(call.args[0])
            # One optimizer step per epoch: `batch_size` conversations (or prompts); a
            # validation file of two prompts, one per worker.
            rows = hyper["batch_size"] if isinstance(hyper.get("batch_size"), int) else 8
            if "rft" in name:
                records = rft_records(2 if "valid" in name else rows, seed=len(files))
            elif "chat" in name:
                records = chat_records(rows)
            else:
                pytest.fail(f"{snippet.id}: cannot tell what data {name!r} holds")
            files[name] = str(write_jsonl(service.data_dir / f"sdk-{name}", records))
    tree = _RunsHere(model=str(model), files=files, base_url=f"{service.base_url}/v1").visit(tree)
    ast.fix_missing_locations(tree)
    cut = next(i for i, stmt in enumerate(tree.body) if _creates_job(stmt)) + 1
    namespace: dict[str, Any] = {"TUNEYARD_API_KEY": service.api_key}
    exec(compile(ast.Module(tree.body[:cut], []), snippet.id, "exec"), namespace)
    return SdkJob(
        namespace,
        ast.Module(tree.body[cut:], []),
        model=model,
        hyperparameters=hyper,
        extension=extension,
        metadata=ast.literal_eval(kwargs["metadata"]),
    )


@pytest.mark.parametrize("snippet", SDK_SNIPPETS, ids=[s.id for s in SDK_SNIPPETS])
def test_the_openai_sdk_snippet_runs_as_written(
    snippet: SdkSnippet,
    service: Service,
    submitted: tuple[dict[str, Submitted], dict[str, SdkJob]],
) -> None:
    from transformers import AutoModelForCausalLM

    job = submitted[1][snippet.id]
    ns = job.namespace
    # A job is a run: wait as every other test here does, then follow it as the snippet does.
    run = service.wait_terminal(ns["job"].id, timeout_s=WAIT_S)
    assert_succeeded(service, run)
    # The snippet's settings reached the run, but use_gpu.
    stored = _leaves(run["spec"])
    for path, value in _leaves(job.extension).items():
        if path != "resources.use_gpu":
            assert stored.get(path) == value, (path, value, stored.get(path))
    assert stored["resources.use_gpu"] is False
    assert run["spec"]["training"]["epochs"] == job.hyperparameters["n_epochs"]
    assert run["metadata"] == job.metadata
    try:
        exec(compile(job.follow, snippet.id, "exec"), ns)
    finally:
        ns["client"].close()
    assert ns["job"].status == "succeeded", ns["job"].error
    if ns["job"].method.type == "reinforcement":
        # OpenAI's RFT job is tuneyard's GRPO: 8 completions per prompt, scaled by
        # compute_multiplier; graded each step, and on the validation file at the end.
        method = run["spec"]["method"]
        assert method["type"] == "grpo", method
        multiplier = job.hyperparameters.get("compute_multiplier", 1)
        assert method["num_generations"] == round(8 * multiplier), method
        assert set(metric_series(service, run["id"], "grade_failures").values()) == {0.0}
        assert "eval_reward" in run["latest_metrics"], run["latest_metrics"]
        assert checkpoints(service, run["id"], "deepspeed"), "no checkpoint recorded"
    model_path = Path(ns["model_path"])
    assert model_path.is_dir(), ns["job"]
    if "lora" in job.extension:
        # The default LoRA export: an adapter, which peft loads onto the base model.
        assert_adapter_loads(model_path, job.model, auto=AutoModelForCausalLM)
    else:
        assert AutoModelForCausalLM.from_pretrained(model_path).config.model_type == "llama"
