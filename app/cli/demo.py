"""`tuneyard demo`: the whole path, offline — service, Ray, DeepSpeed, an exported model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from app.cli.client import ApiError, TuneyardClient
from app.cli.render import watch_run
from app.ports import free_port
from app.services.api_keys import issue_api_key
from app.settings import DEMO_DIRNAME, Settings

console = Console(soft_wrap=True)  # paths stay on one line, copyable
# `tuneyard demo --hub`: the tutorials' model and dataset, where a hub is reachable.
HUB_MODEL = "gpt2"
HUB_DATASET = {"source": "fancyzhx/ag_news", "split": "train", "text_field": "text"}


def run_demo(*, steps: int, port: int | None, hub: bool = False) -> int:
    settings = Settings()
    if hub:
        # Hub ids, as in Ray's and DeepSpeed's tutorials: the workers download them.
        model, dataset = HUB_MODEL, HUB_DATASET
    else:
        model_dir, data_file = _build_assets(settings.home_dir / DEMO_DIRNAME)
        model, dataset = str(model_dir), {"source": str(data_file), "text_field": "text"}
    api_key = issue_api_key(settings.resolved_database_url, name="demo").secret
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"

    console.print(f"[bold]Starting tuneyard[/] on {base} (home {settings.home_dir})")
    env = {**os.environ, "TUNEYARD_PORT": str(port), "TUNEYARD_HOST": "127.0.0.1"}
    log_path = settings.home_dir / "demo-service.log"
    with open(log_path, "ab") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        with TuneyardClient(base, api_key) as client:
            _wait_ready(client, server, log_path)
            return _submit_and_watch(client, model=model, dataset=dataset, steps=steps)
    finally:
        console.print("Stopping the service (and its local Ray head)…")
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def _build_assets(demo_dir: Path) -> tuple[Path, Path]:
    from app.cli.tiny_assets import build_tiny_gpt2, write_jsonl_dataset

    model_dir = demo_dir / "tiny-gpt2"
    data_file = demo_dir / "news.jsonl"
    if not (model_dir / "config.json").exists():
        console.print("Building a tiny GPT-2 and tokenizer locally (no hub needed)…")
        build_tiny_gpt2(model_dir)
    if not data_file.exists():
        write_jsonl_dataset(data_file, rows=2000)
    return model_dir, data_file


def _wait_ready(client: TuneyardClient, server: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 300
    with console.status("Waiting for the service and its Ray head…"):
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the service exited; see {log_path}")
            try:
                health = client.http.get("/healthz").json()
                if health["ray"]["reachable"]:
                    console.print(f"Ray dashboard: {health['ray']['dashboard_url']}")
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(1)
    raise SystemExit(f"the service did not become ready; see {log_path}")


def demo_request(*, model: str, dataset: dict[str, Any], steps: int) -> dict[str, Any]:
    return {
        "model": model,
        "dataset": dataset,
        "training": {
            "max_steps": steps,
            "learning_rate": 3e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
            "lr_scheduler": "cosine",
            "warmup_steps": 3,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"export_hf": True},
        "metadata": {"source": "tuneyard demo"},
    }


def _submit_and_watch(
    client: TuneyardClient, *, model: str, dataset: dict[str, Any], steps: int
) -> int:
    request = demo_request(model=model, dataset=dataset, steps=steps)
    try:
        run = client.create_run(request)
    except ApiError as exc:
        console.print(f"[red]The service refused the demo run:[/] {exc.detail}")
        return 1
    console.print(f"Submitted run [bold]{run['id']}[/] ({model}, ZeRO-2, 2 workers, {steps} steps)")
    run = watch_run(client, run["id"], console)
    if run["status"] != "succeeded":
        console.print(f"[red]Run {run['status']}[/]: {run['error']}")
        return 1
    _show_result(client, run)
    return 0


def _show_result(client: TuneyardClient, run: dict[str, Any]) -> None:
    losses = [
        m["nonfinite"] if m["value"] is None else f"{m['value']:.3f}"
        for m in client.http.get(f"/v1/runs/{run['id']}/metrics", params={"name": "loss"}).json()[
            "data"
        ]
    ]
    console.print(
        f"[green]Succeeded.[/] loss {losses[0]} → {losses[-1]} over {len(losses)} logged steps"
    )
    for ckpt in client.checkpoints(run["id"]):
        console.print(f"  {ckpt['kind']:9} step {ckpt['step']:>4}  {ckpt['path']}")
    model_path = run["output"]["model_path"]
    if model_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model: Any = AutoModelForCausalLM.from_pretrained(model_path)
        prompt = tokenizer("The Lions", return_tensors="pt")
        # A tiny model trained for seconds loops on its likeliest token; the penalty keeps
        # the sample readable.
        out = model.generate(
            **prompt,
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            pad_token_id=tokenizer.pad_token_id,
        )
        console.print(f"Exported model: [bold]{model_path}[/]")
        console.print(f"Sample: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
