// `/submit`: a JSON editor checked by POST /v1/runs/validate as you type, then POST /v1/runs.

import { json, problems } from "./api.js";
import { el } from "./format.js";

const DEBOUNCE_MS = 400;

const editor = document.getElementById("editor");
const exampleSelect = document.getElementById("example");
const submitButton = document.getElementById("submit-run");
const validity = document.getElementById("validity");
const list = document.getElementById("problems");
let examples = {};
let timer = 0;
let generation = 0;

function pretty(value) {
  return value === null || value === undefined ? "" : JSON.stringify(value, null, 2);
}

function showProblems(items) {
  list.replaceChildren(
    ...items.map((p) =>
      el("li", { "data-field": p.field }, p.field ? el("code", {}, p.field) : null, p.field ? " " : null, p.message),
    ),
  );
}

// The examples POST /v1/runs offers in the OpenAPI document (the tutorial setups).
async function loadExamples() {
  const response = await fetch("/openapi.json");
  const document_ = await response.json();
  const content = document_.paths["/v1/runs"].post.requestBody.content["application/json"];
  examples = content.examples || {};
  exampleSelect.replaceChildren(
    ...Object.entries(examples).map(([key, ex]) => el("option", { value: key }, ex.summary || key)),
  );
  useExample(Object.keys(examples)[0]);
}

function useExample(key) {
  if (!key) return;
  editor.value = pretty(examples[key].value);
  check();
}

async function check() {
  const mine = ++generation;
  let body;
  try {
    body = JSON.parse(editor.value);
  } catch (error) {
    validity.textContent = "Not JSON yet.";
    validity.className = "error";
    showProblems([{ field: "", message: error.message }]);
    submitButton.disabled = true;
    return;
  }
  validity.textContent = "Validating…";
  validity.className = "muted";
  try {
    const report = await json("/v1/runs/validate", { method: "POST", body });
    if (mine !== generation) return; // the text changed while this was in flight
    validity.textContent = report.valid ? "Valid: ready to submit." : `${report.errors.length} problem(s):`;
    validity.className = report.valid ? "ok" : "error";
    showProblems(report.errors);
    document.getElementById("resolved").textContent = pretty(report.resolved);
    document.getElementById("estimate").textContent = pretty(report.estimate);
    submitButton.disabled = !report.valid;
  } catch (error) {
    if (mine !== generation) return;
    validity.textContent = "Refused:";
    validity.className = "error";
    showProblems(problems(error));
    submitButton.disabled = true;
  }
}

editor.addEventListener("input", () => {
  clearTimeout(timer);
  timer = setTimeout(check, DEBOUNCE_MS);
});
exampleSelect.addEventListener("change", () => useExample(exampleSelect.value));

submitButton.addEventListener("click", async () => {
  const state = document.getElementById("submit-state");
  submitButton.disabled = true;
  state.textContent = "Submitting…";
  try {
    const run = await json("/v1/runs", { method: "POST", body: editor.value });
    location.href = `/runs/${run.id}`;
  } catch (error) {
    state.textContent = "";
    validity.textContent = `Refused (${error.status}):`;
    validity.className = "error";
    showProblems(problems(error));
  }
});

loadExamples().catch((error) => showProblems([{ field: "", message: error.message }]));
