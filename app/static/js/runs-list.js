// `/`: every run, newest first, refreshed every 2 seconds.

import { json } from "./api.js";
import { Sparkline } from "./charts.js";
import { dateTime, duration, el, methodOf, number, parallelism, progressBar, statusBadge } from "./format.js";
import { ALL, TERMINAL } from "./statuses.js";

const REFRESH_MS = 2000;

const form = document.getElementById("filters");
const tbody = document.querySelector("#runs tbody");
const state = document.getElementById("list-state");
const compareButton = document.getElementById("compare-selected");
const selected = new Set();
const losses = new Map(); // run id -> { values, lastStep, done, spark }

// The statuses a run can have, from the contract (statuses.js), after "any".
form.status.append(...ALL.map((status) => el("option", {}, status)));

// The filters live in the address (`?status=running&metadata.team=nlp`), as in the API.
function showFilters() {
  const params = new URLSearchParams(location.search);
  form.status.value = params.get("status") || "";
  form.metadata.value = [...params]
    .filter(([k]) => k.startsWith("metadata."))
    .map(([k, v]) => `${k.slice(9)}=${v}`)
    .join(", ");
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const params = new URLSearchParams();
  if (form.status.value) params.set("status", form.status.value);
  for (const pair of form.metadata.value.split(",")) {
    const [key, ...rest] = pair.split("=");
    if (key.trim() && rest.length) params.set(`metadata.${key.trim()}`, rest.join("=").trim());
  }
  history.replaceState(null, "", params.size ? `?${params}` : location.pathname);
  refresh();
});

compareButton.addEventListener("click", () => {
  location.href = `/compare?runs=${[...selected].join(",")}`;
});

function lossOf(run) {
  if (!losses.has(run.id)) {
    losses.set(run.id, { values: [], lastStep: -1, done: false, spark: new Sparkline() });
  }
  return losses.get(run.id);
}

// A run's loss series, read incrementally; a finished run's is read once more, then kept.
async function updateLoss(run) {
  const known = lossOf(run);
  if (known.done) return;
  const finished = TERMINAL.has(run.status);
  const page = await json(
    `/v1/runs/${run.id}/metrics?name=loss&after_step=${known.lastStep}&limit=1000`,
  );
  for (const m of page.data) {
    if (m.step > known.lastStep && m.value !== null) {
      known.values.push(m.value);
      known.lastStep = m.step;
    }
  }
  known.done = finished;
  if (page.data.length) known.spark.set(known.values);
}

function row(run) {
  const spec = run.spec || {};
  const check = el("input", {
    type: "checkbox",
    checked: selected.has(run.id),
    "aria-label": `select ${run.id}`,
    onchange: (event) => {
      event.target.checked ? selected.add(run.id) : selected.delete(run.id);
      compareButton.disabled = selected.size < 2;
    },
  });
  const loss = run.latest_metrics?.loss;
  const lossText = loss === undefined ? "–" : loss === null ? run.nonfinite_metrics?.loss : number(loss);
  updateLoss(run).catch((error) => console.warn(`loss of ${run.id}`, error));
  const queued = run.queue?.position ? ` (#${run.queue.position} in queue)` : "";
  return el(
    "tr",
    { "data-run-id": run.id },
    el("td", {}, check),
    el("td", {}, el("a", { href: `/runs/${run.id}` }, run.id)),
    el("td", { title: run.queue?.reason || "" }, statusBadge(run.status), queued),
    el("td", { class: "model", title: spec.model }, String(spec.model ?? "")),
    el("td", {}, `${spec.task || "causal_lm"} · ${methodOf(spec)}`),
    el("td", {}, parallelism(spec)),
    el("td", {}, progressBar(run.progress)),
    el("td", { class: "loss" }, el("span", { class: "loss-value" }, lossText), lossOf(run).spark.element),
    el("td", {}, dateTime(run.created_at)),
    el("td", {}, duration(run.started_at, run.finished_at)),
  );
}

async function refresh() {
  const params = new URLSearchParams(location.search);
  params.set("limit", "50");
  try {
    const list = await json(`/v1/runs?${params}`);
    tbody.replaceChildren(...list.data.map(row));
    document.getElementById("no-runs").hidden = list.data.length > 0;
    state.textContent = `updated ${new Date().toLocaleTimeString()}`;
    state.classList.remove("error");
  } catch (error) {
    state.textContent = error.message;
    state.classList.add("error");
  }
}

async function poll() {
  await refresh();
  setTimeout(poll, REFRESH_MS);
}

showFilters();
poll();
