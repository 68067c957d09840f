// The /v1 API with the user's key: entered once, kept in sessionStorage, asked for again on a 401.

const KEY = "tuneyard.apiKey";

let pendingPrompt = null;

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// Resolves once the user has entered a key; every caller waiting on a 401 shares one prompt.
function promptForKey(refused) {
  if (pendingPrompt) return pendingPrompt;
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-error").hidden = !refused;
  input.value = "";
  pendingPrompt = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      dialog.close();
      pendingPrompt = null;
      resolve();
    };
  });
  dialog.showModal();
  input.focus();
  return pendingPrompt;
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

// fetch() against the API; waits for a key (and retries) while the answer is 401.
export async function request(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: authHeaders(options.headers) });
    if (response.status !== 401) return response;
    await promptForKey(Boolean(apiKey()));
  }
}

export class ApiError extends Error {
  constructor(status, body) {
    super(typeof body?.detail === "string" ? body.detail : `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

// JSON in, JSON out; throws ApiError with the service's body on any other status than 2xx.
export async function json(path, { method = "GET", body, headers } = {}) {
  const options = { method, headers: { Accept: "application/json", ...headers } };
  if (body !== undefined) {
    options.body = typeof body === "string" ? body : JSON.stringify(body);
    options.headers["Content-Type"] = "application/json";
  }
  const response = await request(path, options);
  const text = await response.text();
  let parsed = null;
  try {
    parsed = text ? JSON.parse(text) : null;
  } catch {
    parsed = { detail: text };
  }
  if (!response.ok) throw new ApiError(response.status, parsed);
  return parsed;
}

// The problems of a 422 (`detail` a list of {field, message}) or any other error, as a list.
export function problems(error) {
  const detail = error?.body?.detail;
  if (Array.isArray(detail)) return detail.map((p) => ({ field: p.field || "", message: p.message }));
  return [{ field: "", message: error?.message || String(error) }];
}
