// Server-Sent Events over fetch(): EventSource cannot send an Authorization header.
// Reconnects with Last-Event-ID after a dropped connection, so nothing is lost or repeated.

import { request } from "./api.js";

function parseBlock(block) {
  const event = { type: "message", data: "", id: null };
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // a comment: the server's keep-alive ping
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event.type = value;
    else if (field === "data") data.push(value);
    else if (field === "id") event.id = value;
  }
  event.data = data.join("\n");
  return data.length || event.type !== "message" ? event : null;
}

// Calls onEvent({type, data, id}) for each event until an `end` event or stop() is called.
export function followStream(path, onEvent, { retryMs = 1000 } = {}) {
  let lastId = null;
  let stopped = false;
  let controller = null;

  async function connectOnce() {
    controller = new AbortController();
    const headers = { Accept: "text/event-stream" };
    if (lastId) headers["Last-Event-ID"] = lastId;
    const response = await request(path, { headers, signal: controller.signal });
    if (!response.ok) throw new Error(`stream answered ${response.status}`);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = parseBlock(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (!event) continue;
        if (event.id) lastId = event.id;
        onEvent(event);
        if (event.type === "end") return true;
      }
    }
  }

  (async () => {
    while (!stopped) {
      try {
        if (await connectOnce()) return;
      } catch (error) {
        if (stopped) return;
        console.warn("stream dropped, reconnecting", error);
      }
      await new Promise((resolve) => setTimeout(resolve, retryMs));
    }
  })();

  return {
    stop() {
      stopped = true;
      controller?.abort();
    },
  };
}
