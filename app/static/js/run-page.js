// `/runs/{id}`: one run, live. Curves come from the run's SSE stream; the rest is polled.

import { json, problems, request } from "./api.js";
import { StepChart } from "./charts.js";
import { copyButton, dateTime, duration, el, methodOf, number, parallelism, progressBar, statusBadge } from "./format.js";
import { followStream } from "./sse.js";
import { RESUMABLE, TERMINAL } from "./statuses.js";

const REFRESH_MS = 2000;
const ANSI_ESCAPES = /\x1b\[[0-9;]*[A-Za-z]/g;
const CHARTS = {
  loss: "loss",
  learning_rate: "learning rate",
  tokens_per_second: "tokens/s",
  eval_loss: "eval loss",
  // Method grpo's: shown once the run reports one (other methods have none).
  reward: "reward",
  eval_reward: "eval reward",
};

const runId = decodeURIComponent(location.pathname.split("/")[2] || "");
const base = `/v1/runs/${encodeURIComponent(runId)}`;
const charts = Object.fromEntries(
  Object.entries(CHARTS).map(([name, title]) => [
    name,
    new StepChart(document.getElementById(`chart-${name}`), { title }),
  ]),
);
const shownEvents = new Set();
let run = null;
let stream = null;
let validated = false;

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function pretty(value) {
  return JSON.stringify(value, null, 2);
}

function renderRun() {
  document.title = `${run.id} · tuneyard`;
  setText("run-title", run.id);
  document.getElementById("run-status").replaceChildren(statusBadge(run.status));
  const spec = run.spec;
  const latest = run.latest_metrics || {};
  const summary = [
    ["Model", spec.model],
    ["Task · method", `${spec.task || "causal_lm"} · ${methodOf(spec)}`],
    ["Parallelism", parallelism(spec)],
    ["Progress", progressBar(run.progress)],
    ["Attempt", String(run.attempt)],
    ["Priority", `${spec.priority ?? 50}${spec.preemptible === false ? " · not preemptible" : ""}`],
    // Only while queued: its place in the scheduler's order and why it waits.
    ...(run.queue ? [["Queue", `#${run.queue.position ?? "?"} · ${run.queue.reason || "waiting for the scheduler"}`]] : []),
    ["Loss", number(latest.loss)],
    ...(latest.reward !== undefined ? [["Reward", number(latest.reward)]] : []),
    ["Tokens/s", number(latest.tokens_per_second)],
    ["Created", dateTime(run.created_at)],
    ["Duration", duration(run.started_at, run.finished_at)],
    ["ETA", run.progress.eta_seconds ? `${Math.round(run.progress.eta_seconds)}s` : "–"],
    // While running: when the steps will be done at the measured step time.
    ["Estimated finish", dateTime(run.progress.estimated_finish)],
    ["Result", resultText(run.result)],
  ];
  document
    .getElementById("run-summary")
    .replaceChildren(...summary.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const error = document.getElementById("run-error");
  error.hidden = !run.error;
  error.textContent = run.error ? `${run.error.code}: ${run.error.message}` : "";
  document.getElementById("cancel").disabled = TERMINAL.has(run.status) || run.status === "cancelling";
  document.getElementById("resume").disabled = !RESUMABLE.has(run.status);
  setText("spec", pretty(spec));
  renderModel();
}

function resultText(result) {
  if (!result) return "–";
  const parts = [];
  if (result.stop_reason) parts.push(result.stop_reason.replace("_", " "));
  if (result.best_step != null) {
    parts.push(`best ${result.best_metric} ${number(result.best_value)} at step ${result.best_step}`);
  }
  return parts.join(" · ") || "–";
}

function renderModel() {
  const box = document.getElementById("model-output");
  const path = run.output?.model_path;
  if (!path) return;
  const command = `tuneyard download ${run.id} ./${run.id}-model`;
  box.classList.remove("muted");
  box.replaceChildren(
    el("div", { class: "path-row" }, el("code", {}, path), copyButton(path)),
    el("div", { class: "path-row" }, el("code", {}, command), copyButton(command)),
  );
}

async function loadCheckpoints() {
  const list = await json(`${base}/checkpoints`);
  document.querySelector("#checkpoints tbody").replaceChildren(
    ...list.data.map((c) =>
      el(
        "tr",
        {},
        el("td", {}, String(c.step)),
        // The best by the run's best metric (kept whatever keep_last says), and what
        // keep_last has deleted from storage.
        el(
          "td",
          {},
          c.kind,
          c.best ? el("span", { class: "tag tag-best" }, " best") : null,
          c.pruned ? el("span", { class: "tag muted" }, " pruned") : null,
        ),
        el("td", {}, String(c.attempt)),
        el("td", {}, el("code", { class: "path" }, c.path)),
        el("td", {}, copyButton(c.path)),
      ),
    ),
  );
}

function addEvent(event) {
  if (shownEvents.has(event.id)) return;
  shownEvents.add(event.id);
  const repeats = event.repeats > 1 ? ` (×${event.repeats})` : "";
  document.getElementById("events").append(
    el(
      "li",
      { class: `event event-${event.type}` },
      el("time", {}, dateTime(event.created_at)),
      " ",
      el("strong", {}, event.type),
      event.status ? " " : null,
      event.status ? statusBadge(event.status) : null,
      el("div", {}, `${event.message}${repeats}`),
      el("small", { class: "muted" }, `attempt ${event.attempt}`),
    ),
  );
}

async function loadEvents() {
  const list = await json(`${base}/events?limit=1000`);
  list.data.forEach(addEvent);
}

async function loadLog() {
  const box = document.getElementById("log");
  const response = await request(`${base}/logs?tail=200`);
  const text = await response.text();
  if (!response.ok) {
    box.textContent = `(no log yet: ${response.status})`;
    return;
  }
  // Ray's log colours its prefixes with ANSI escapes; a <pre> would show them as junk.
  box.textContent = text.replace(ANSI_ESCAPES, "") || "(empty)";
  if (document.getElementById("follow-log").checked) box.scrollTop = box.scrollHeight;
}

// What /validate makes of the request as submitted: the resolved DeepSpeed config and the
// memory estimate the worker's setup was built from.
async function loadValidation() {
  const state = document.getElementById("validate-state");
  try {
    const report = await json("/v1/runs/validate", { method: "POST", body: run.spec });
    state.textContent = report.valid
      ? "The request as submitted validates today."
      : `Today it would be refused: ${report.errors.map((p) => `${p.field}: ${p.message}`).join("; ")}`;
    setText("resolved", pretty(report.resolved));
    setText("estimate", pretty(report.estimate));
  } catch (error) {
    state.textContent = problems(error).map((p) => `${p.field} ${p.message}`).join("; ");
  }
}

function onStreamEvent(event) {
  if (event.type === "metric") {
    const m = JSON.parse(event.data);
    if (m.name in charts && m.value !== null) {
      charts[m.name].element.hidden = false;
      charts[m.name].add(`attempt ${m.attempt}`, m.step, m.value);
    }
  } else if (event.type === "event") {
    addEvent(JSON.parse(event.data));
  } else if (event.type === "end") {
    refresh();
  }
}

function startStream() {
  stream?.stop();
  stream = followStream(`${base}/events/stream`, onStreamEvent);
}

async function refresh() {
  run = await json(base);
  renderRun();
  await Promise.all([loadCheckpoints(), loadLog()]);
  if (!validated) {
    validated = true;
    loadValidation();
  }
}

let polling = false;

// Every 2 s until the run is finished; a resume starts it again.
async function poll() {
  polling = true;
  try {
    await refresh();
  } catch (error) {
    document.getElementById("run-error").hidden = false;
    setText("run-error", error.status === 404 ? `No run ${runId} (or not yours).` : error.message);
  }
  if (!run || !TERMINAL.has(run.status)) setTimeout(poll, REFRESH_MS);
  else polling = false;
}

async function control(action) {
  const button = document.getElementById(action);
  button.disabled = true;
  try {
    run = await json(`${base}/${action}`, { method: "POST" });
    renderRun();
    if (action === "resume") {
      startStream();
      if (!polling) poll();
    }
  } catch (error) {
    alert(problems(error).map((p) => p.message).join("\n"));
  }
}

document.getElementById("cancel").addEventListener("click", () => control("cancel"));
document.getElementById("resume").addEventListener("click", () => control("resume"));
document.getElementById("follow-log").addEventListener("change", (event) => {
  const box = document.getElementById("log");
  if (event.target.checked) box.scrollTop = box.scrollHeight;
});

loadEvents().catch(() => {});
startStream();
poll();
