// Talking to the explorer's JSON routes (aiayn/explore/app.py).

export class ApiError extends Error {}

async function handle(response) {
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok || body === null) {
    const message = body && body.error ? body.error : `the server answered ${response.status}`;
    throw new ApiError(message);
  }
  return body;
}

export async function getJSON(path) {
  return handle(await fetch(path, { headers: { Accept: "application/json" } }));
}

export async function postJSON(path, payload) {
  return handle(await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "application/json" },
    body: JSON.stringify(payload),
  }));
}

// A matrix the server packed (aiayn.explore.probes.pack_matrix): float32 little-endian, base64.
export function unpack(packed) {
  const bytes = Uint8Array.from(atob(packed.data), (c) => c.charCodeAt(0));
  const values = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  return { shape: packed.shape, values };
}

// Calls fn at most once per `ms` of quiet (typing in a text box).
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

// The token preview under a text box: chips, "n / limit tokens", the model's message when the
// text cannot be taken. `onState(ok)` learns whether the text may be sent.
export function tokenPreview({ input, chips, count, message, side = "source", onState = () => {} }) {
  let seq = 0;
  const update = debounce(async () => {
    const mine = ++seq;
    try {
      const r = await postJSON("/api/tokenize", { text: input.value, side });
      if (mine !== seq) return;
      chips.replaceChildren(...r.labels.map((l) => el("span", { class: "chip" }, l)));
      count.textContent = r.count === null ? "" : `${r.count} / ${r.limit} tokens`;
      count.classList.toggle("over", r.error !== null);
      message.textContent = r.error || "";
      onState(r.error === null);
    } catch (err) {
      if (mine !== seq) return;
      message.textContent = err.message;
      onState(false);
    }
  }, 150);
  input.addEventListener("input", update);
  update();
  return update;
}

// document.createElement with attributes and children (strings become text).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function svgEl(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit === 0 ? `${value} B` : `${value.toFixed(2)} ${units[unit]}`;
}

// The tooltip that follows the mouse.
const tip = () => document.getElementById("tooltip");
export function showTip(event, text) {
  const t = tip();
  t.textContent = text;
  t.hidden = false;
  t.style.left = `${event.clientX + 14}px`;
  t.style.top = `${event.clientY + 12}px`;
}
export function hideTip() { tip().hidden = true; }
