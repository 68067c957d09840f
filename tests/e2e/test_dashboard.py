"""The web dashboard in a real browser (the system Chromium, driven by Playwright) against
the real service: the key prompt, the runs list, a run's live curves and its cancel button,
the comparison of two runs, and the submit form's checks. Screenshots of each page go to
docs/dashboard-*.png."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright_api

from app.cli.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import Service
from tests.e2e.helpers import prompt_records, small_grpo_request, write_jsonl

pytestmark = pytest.mark.e2e

# The screenshots the README shows are refreshed with TUNEYARD_SCREENSHOTS=docs; otherwise
# each run's go to a temporary folder, so running the tests leaves the checkout as it was.
SCREENSHOTS = (
    Path(__file__).resolve().parents[2] / "docs"
    if os.environ.get("TUNEYARD_SCREENSHOTS") == "docs"
    else Path(tempfile.gettempdir()) / "tuneyard-dashboard-screenshots"
)
VIEWPORT = {"width": 1280, "height": 800}
# Long enough to still be training when the test cancels it from the page.
LONG_STEPS = 400
# Where the long run waits (worker/training/step_gate.py) while the list is checked, rather
# than spend a core training on; the run page lets it go on, to draw new losses live.
LONG_HOLD_AT = 3
SHORT_STEPS = 8


def _request(model: Path, data: Path, *, steps: int, name: str, seed: int = 42) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data), "text_field": "text"},
        "training": {
            "max_steps": steps,
            "learning_rate": 3e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
            "seed": seed,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 1},
        "checkpointing": {"every_n_steps": 4, "export_hf": True},
        "fault_tolerance": {"max_failures": 0},
        "metadata": {"test": "dashboard", "run": name},
    }


@pytest.fixture(scope="module")
def dataset(service: Service) -> Path:
    return write_jsonl_dataset(service.data_dir / "dashboard.jsonl", rows=400)


@pytest.fixture(scope="module")
def long_run(service: Service, tiny_model_dir: Path, dataset: Path) -> dict[str, Any]:
    run = service.submit(_request(tiny_model_dir, dataset, steps=LONG_STEPS, name="long"))
    service.hold_at(run["id"], LONG_HOLD_AT)
    return run


@pytest.fixture(scope="module")
def short_run(service: Service, tiny_models_root: Path) -> dict[str, Any]:
    """A grpo run, whose page draws its rewards too."""
    prompts = write_jsonl(service.data_dir / "dashboard-prompts.jsonl", prompt_records(16))
    return service.submit(
        {
            **small_grpo_request(tiny_models_root, prompts),
            "training": {"max_steps": SHORT_STEPS, "seed": 7, "eval_every_n_steps": 4},
            "resources": {"num_workers": 1},
            "checkpointing": {"every_n_steps": 4, "export_hf": True},
            "fault_tolerance": {"max_failures": 0},
            "metadata": {"test": "dashboard", "run": "short"},
        }
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    # Never skipped: .ci/run installs it, and so must anyone running the tests.
    assert chromium, "install Debian's chromium (apt-get install chromium), as .ci/run does"
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()


# Refused on purpose: ReDoc's bundle shows its maker's logo from its CDN, which the page's
# policy keeps it from loading (app/api/dashboard.py).
_REFUSED_ON_PURPOSE = "https://cdn.redoc.ly/"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab (so no key yet); fails the test on any uncaught script error, and on
    anything a page's Content-Security-Policy refused (Chromium reports each on the
    console), as a script or style inline would be."""
    context = browser.new_context(viewport=VIEWPORT)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    refused: list[str] = []
    tab.on(
        "console",
        lambda message: (
            refused.append(message.text)
            if "Content Security Policy" in message.text and _REFUSED_ON_PURPOSE not in message.text
            else None
        ),
    )
    yield tab
    context.close()
    assert not errors, errors
    assert not refused, refused


def open_with_key(page: Any, service: Service, path: str) -> None:
    """Open a page; the service wants a key, so the page asks for one: enter it."""
    page.goto(service.base_url + path)
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    dialog.locator("input").fill(service.api_key)
    dialog.locator("button[type=submit]").click()
    dialog.wait_for(state="hidden")


def screenshot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"dashboard-{name}.png"))


def wait_until(page: Any, expression: str, timeout: float = 30_000) -> None:
    """`page.wait_for_function`, polled from here: its polling evaluates the expression as a
    string inside the page, which the pages' policy refuses (no 'unsafe-eval')."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout / 1000:.0f} s: {expression}"
        page.wait_for_timeout(100)


def points(page: Any, chart: str) -> int:
    return int(page.locator(f"#chart-{chart}").get_attribute("data-points") or 0)


def test_a_wrong_key_is_refused_and_the_list_shows_the_runs(
    service: Service, page: Any, long_run: dict[str, Any], short_run: dict[str, Any]
) -> None:
    page.goto(service.base_url + "/")
    dialog = page.locator("#key-dialog")
    dialog.locator("input").fill("not-a-key")
    dialog.locator("button[type=submit]").click()
    # Asked again, saying why; nothing is listed without a valid key.
    page.locator("#key-dialog .key-error").wait_for(state="visible")
    assert page.locator("#runs tbody tr").count() == 0
    dialog.locator("input").fill(service.api_key)
    dialog.locator("button[type=submit]").click()

    for run in (long_run, short_run):
        page.locator(f'tr[data-run-id="{run["id"]}"]').wait_for()
    row = page.locator(f'tr[data-run-id="{long_run["id"]}"]')
    assert "ZeRO-2 · 1 worker" in row.inner_text()
    assert "causal_lm · sft" in row.inner_text()
    # Newest first.
    ids = page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert ids.index(short_run["id"]) < ids.index(long_run["id"])

    # A metadata filter narrows the list, and lives in the address.
    page.fill("#filters input[name=metadata]", "run=short")
    page.click("#filters button[type=submit]")
    wait_until(page, "document.querySelectorAll('#runs tbody tr').length === 1", timeout=10_000)
    assert "metadata.run=short" in page.url
    page.goto(service.base_url + "/")  # the key is kept for the tab: no prompt this time
    page.locator(f'tr[data-run-id="{long_run["id"]}"]').wait_for()
    assert not page.locator("#key-dialog").is_visible()
    # The loss column fills in as the runs train, each loss with its sparkline (from two
    # points on), kept across refreshes. Waited for by state, not by the clock: once the
    # service holds two of the long run's losses, the next refresh (2 s) shows them. With
    # the machine's cores busy, a run's second step can come minutes after its submission.
    deadline = time.monotonic() + 600
    while _losses(service, long_run["id"]) < 2:
        assert time.monotonic() < deadline, "the long run reported no second loss in 600 s"
        time.sleep(1)
    wait_until(
        page,
        "[...document.querySelectorAll('.loss-value')].some(e => /\\d/.test(e.textContent))",
        timeout=30_000,
    )
    page.locator(f'tr[data-run-id="{long_run["id"]}"] .spark canvas').wait_for(timeout=30_000)
    screenshot(page, "list")


def _let_go(service: Service, run_id: str) -> None:
    """The long run, held at LONG_HOLD_AT (or on its way there), trains on."""
    service.wait_held(service.hold_at(run_id, LONG_HOLD_AT), run_id)
    service.let_go(run_id)


def _losses(service: Service, run_id: str) -> int:
    """How many losses the service holds of `run_id`."""
    answer = service.http.get(f"/v1/runs/{run_id}/metrics", params={"name": "loss", "limit": 10})
    answer.raise_for_status()
    return len(answer.json()["data"])


def test_the_run_page_draws_the_loss_live_and_cancels_the_run(
    service: Service, page: Any, long_run: dict[str, Any]
) -> None:
    open_with_key(page, service, f"/runs/{long_run['id']}")
    wait_until(
        page, "Number(document.querySelector('#chart-loss').dataset.points) > 0", timeout=240_000
    )
    first = points(page, "loss")
    _let_go(service, long_run["id"])
    wait_until(
        page,
        f"Number(document.querySelector('#chart-loss').dataset.points) > {first}",
        timeout=60_000,
    )
    assert service.http.get(f"/v1/runs/{long_run['id']}").json()["status"] == "running"
    assert points(page, "learning_rate") > 0 and points(page, "tokens_per_second") > 0
    assert not page.locator("#chart-reward").is_visible()  # an sft run has no rewards
    # The request as submitted, and what /validate resolves it to.
    assert json.loads(page.locator("#spec").inner_text())["training"]["max_steps"] == LONG_STEPS
    wait_until(page, "document.querySelector('#resolved').textContent.includes('zero')")
    page.locator("#events li").first.wait_for()
    wait_until(page, "!document.querySelector('#log').textContent.startsWith('…')", timeout=120_000)
    screenshot(page, "run")

    page.click("#cancel")
    run = service.wait_terminal(long_run["id"], timeout_s=120)
    assert run["status"] == "cancelled"
    assert run["progress"]["step"] < LONG_STEPS
    page.locator("#run-status .status-cancelled").wait_for(timeout=180_000)
    assert page.locator("#resume").is_enabled()


def test_a_finished_run_shows_its_checkpoints_model_and_log(
    service: Service, page: Any, short_run: dict[str, Any]
) -> None:
    run = service.wait_terminal(short_run["id"], timeout_s=300)
    assert run["status"] == "succeeded", run["error"]
    open_with_key(page, service, f"/runs/{run['id']}")
    page.locator("#run-status .status-succeeded").wait_for()
    assert page.locator("#cancel").is_disabled()
    wait_until(
        page, f"Number(document.querySelector('#chart-loss').dataset.points) === {SHORT_STEPS}"
    )
    # A grpo run's rewards, charted beside its loss (hidden for runs that have none).
    wait_until(
        page, f"Number(document.querySelector('#chart-reward').dataset.points) === {SHORT_STEPS}"
    )
    wait_until(page, "Number(document.querySelector('#chart-eval_reward').dataset.points) === 2")
    assert page.locator("#chart-reward").is_visible()
    assert "Reward" in page.locator("#run-summary").inner_text()
    checkpoints = service.http.get(f"/v1/runs/{run['id']}/checkpoints").json()["data"]
    table = page.locator("#checkpoints tbody")
    wait_until(
        page, f"document.querySelectorAll('#checkpoints tbody tr').length === {len(checkpoints)}"
    )
    for checkpoint in checkpoints:
        assert checkpoint["path"] in table.inner_text()
    model = page.locator("#model-output").inner_text()
    assert run["output"]["model_path"] in model
    assert f"tuneyard download {run['id']}" in model
    events = page.locator("#events").inner_text()
    assert "queued" in events and "succeeded" in events
    wait_until(page, "document.querySelector('#log').textContent.includes('tuneyard')")
    assert "\x1b[" not in page.locator("#log").inner_text()


def test_compare_overlays_the_loss_of_two_runs(
    service: Service, page: Any, long_run: dict[str, Any], short_run: dict[str, Any]
) -> None:
    short = service.wait_terminal(short_run["id"], timeout_s=600)
    assert short["status"] == "succeeded", short["error"]
    long_steps = service.wait_terminal(long_run["id"], timeout_s=300)["progress"]["step"]
    open_with_key(page, service, f"/compare?runs={long_run['id']},{short_run['id']}")
    wait_until(
        page, "document.querySelectorAll('#compare-table tbody tr').length === 2", timeout=30_000
    )
    # Both curves, all steps: the rows come first, the metrics they are drawn from after
    # (later still with the machine's cores busy), so the chart is awaited, not read at once.
    wait_until(
        page,
        "Number(document.querySelector('#chart-compare').dataset.points) >= "
        f"{SHORT_STEPS + long_steps - 2}",
        timeout=60_000,
    )
    legend = page.locator("#chart-compare .u-legend").inner_text()
    assert long_run["id"] in legend and short_run["id"] in legend
    screenshot(page, "compare")


def test_submit_lists_problems_by_field_then_creates_the_run(
    service: Service, page: Any, tiny_model_dir: Path, dataset: Path
) -> None:
    open_with_key(page, service, "/submit")
    # Prefilled with one of the API's examples, and checked at once.
    wait_until(page, "document.querySelector('#editor').value.includes('model')")
    wait_until(page, "!document.querySelector('#validity').textContent.includes('…')")

    bad = _request(tiny_model_dir, dataset, steps=SHORT_STEPS, name="form")
    bad["training"]["learning_rate"] = -1
    bad["deepspeed"]["zero_stage"] = 7
    page.fill("#editor", json.dumps(bad, indent=2))
    problem = page.locator('#problems li[data-field="training.learning_rate"]')
    problem.wait_for(timeout=60_000)
    assert "greater than 0" in problem.inner_text()
    page.locator('#problems li[data-field="deepspeed.zero_stage"]').wait_for()
    assert page.locator("#submit-run").is_disabled()
    screenshot(page, "submit")

    good = _request(tiny_model_dir, dataset, steps=SHORT_STEPS, name="form")
    page.fill("#editor", json.dumps(good, indent=2))
    # Bounds, not expectations: validate counts the data in a subprocess (a few seconds
    # idle, far more with the machine's cores busy).
    page.locator("#validity.ok").wait_for(timeout=180_000)
    assert page.locator("#problems li").count() == 0
    assert "zero_optimization" in page.locator("#resolved").inner_text()
    page.click("#submit-run")
    page.wait_for_url(f"{service.base_url}/runs/run_*", timeout=60_000)
    run_id = page.url.rsplit("/", 1)[-1]
    run = service.http.get(f"/v1/runs/{run_id}").json()
    assert run["metadata"] == {"test": "dashboard", "run": "form"}
    service.http.post(f"/v1/runs/{run_id}/cancel")  # its training is not what is tested here
    service.wait_terminal(run_id, timeout_s=120)


def test_the_api_docs_work_under_their_policies(service: Service, page: Any) -> None:
    """Swagger UI (the pages' policy: nothing inline) and ReDoc (its own) render the API and
    answer from it; the fixture fails the test on anything either policy refused."""
    page.goto(service.base_url + "/docs")
    page.locator(".swagger-ui .info .title").wait_for()
    assert "tuneyard" in page.locator(".swagger-ui .info .title").inner_text()
    page.locator(".opblock-summary-path", has_text="/healthz").first.click()
    page.locator("button.try-out__btn").first.click()
    page.locator("button.execute").first.click()
    page.locator(".live-responses-table tbody .response-col_status").first.wait_for()
    assert (
        page.locator(".live-responses-table tbody .response-col_status").first.inner_text() == "200"
    )

    page.goto(service.base_url + "/redoc")
    page.locator("h1", has_text="tuneyard").wait_for()
    page.locator("input[placeholder='Search...']").fill("cancel")
    page.locator("[data-role='search:results'] li", has_text="Cancel a run").wait_for()
