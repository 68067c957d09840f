// `/compare?runs=a,b`: the loss curves of two or more runs on one step axis.

import { json } from "./api.js";
import { StepChart } from "./charts.js";
import { el, number, parallelism, statusBadge } from "./format.js";

const picker = document.getElementById("run-picker");
const chart = new StepChart(document.getElementById("chart-compare"), { title: "loss", height: 320 });

function chosen() {
  const value = new URLSearchParams(location.search).get("runs") || "";
  return value.split(",").map((id) => id.trim()).filter(Boolean);
}

async function allLosses(runId) {
  const values = [];
  let cursor = null;
  do {
    const params = new URLSearchParams({ name: "loss", limit: "1000" });
    if (cursor) params.set("cursor", cursor);
    const page = await json(`/v1/runs/${encodeURIComponent(runId)}/metrics?${params}`);
    values.push(...page.data);
    cursor = page.next_cursor;
  } while (cursor);
  return values;
}

async function fillPicker(ids) {
  const list = await json("/v1/runs?limit=100");
  const known = new Set(list.data.map((r) => r.id));
  const options = list.data.map((r) =>
    el("option", { value: r.id, selected: ids.includes(r.id) }, `${r.id} · ${r.status} · ${r.spec.model}`),
  );
  // Runs named in the address but older than the list still show as chosen.
  for (const id of ids) if (!known.has(id)) options.push(el("option", { value: id, selected: true }, id));
  picker.replaceChildren(...options);
}

async function compare(ids) {
  chart.clear();
  const rows = [];
  for (const id of ids) {
    const [run, losses] = await Promise.all([json(`/v1/runs/${encodeURIComponent(id)}`), allLosses(id)]);
    for (const m of losses) if (m.value !== null) chart.add(id, m.step, m.value);
    rows.push(
      el(
        "tr",
        {},
        el("td", {}, el("a", { href: `/runs/${id}` }, id)),
        el("td", {}, statusBadge(run.status)),
        el("td", {}, String(run.spec.model)),
        el("td", {}, parallelism(run.spec)),
        el("td", {}, String(run.progress.step)),
        el("td", {}, number(run.latest_metrics?.loss)),
      ),
    );
  }
  document.querySelector("#compare-table tbody").replaceChildren(...rows);
}

document.getElementById("pick").addEventListener("submit", (event) => {
  event.preventDefault();
  const ids = [...picker.selectedOptions].map((o) => o.value);
  history.replaceState(null, "", `?runs=${ids.join(",")}`);
  compare(ids);
});

const ids = chosen();
await fillPicker(ids);
if (ids.length) await compare(ids);
