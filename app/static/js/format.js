// How values read on the pages.

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

export function statusBadge(status) {
  return el("span", { class: `status status-${status}` }, status);
}

export function number(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString();
  return Number(value.toPrecision(digits)).toString();
}

export function dateTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

export function duration(startIso, endIso) {
  if (!startIso) return "–";
  const seconds = Math.max(0, ((endIso ? new Date(endIso) : new Date()) - new Date(startIso)) / 1000);
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${Math.round(seconds % 60)}s`;
  return `${Math.floor(seconds / 3600)}h ${Math.round((seconds % 3600) / 60)}m`;
}

export function methodOf(spec) {
  const method = spec.method?.type || "sft";
  return spec.lora ? `${method} + LoRA` : method;
}

// ZeRO stage, tensor-parallel size and workers: how the run is spread over the cluster.
export function parallelism(spec) {
  const deepspeed = spec.deepspeed || {};
  const parts = [`ZeRO-${deepspeed.zero_stage ?? 3}`];
  if ((deepspeed.tensor_parallel_size || 1) > 1) parts.push(`TP ${deepspeed.tensor_parallel_size}`);
  const workers = spec.resources?.num_workers ?? 2;
  parts.push(`${workers} worker${workers === 1 ? "" : "s"}${spec.resources?.use_gpu ? " (GPU)" : ""}`);
  return parts.join(" · ");
}

export function progressBar(progress) {
  const fraction = progress?.fraction ?? 0;
  const label = progress?.total_steps ? `${progress.step}/${progress.total_steps}` : `${progress?.step ?? 0}`;
  // The width through the element's style object: the pages' policy refuses style attributes.
  const fill = el("div", { class: "progress-fill" });
  fill.style.width = `${Math.round(fraction * 100)}%`;
  return el(
    "div",
    { class: "progress", title: label },
    fill,
    el("span", { class: "progress-label" }, label),
  );
}

export function copyButton(text) {
  return el(
    "button",
    {
      class: "copy",
      type: "button",
      title: "Copy",
      onclick: async (event) => {
        await navigator.clipboard?.writeText(text).catch(() => {});
        event.target.textContent = "Copied";
        setTimeout(() => (event.target.textContent = "Copy"), 1200);
      },
    },
    "Copy",
  );
}
