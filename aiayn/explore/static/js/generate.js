// View 2: decoding step by step (POST /api/generate runs aiayn.generate's decode loop): each step's
// token, the top-k next-token probabilities, and the KV cache of every layer filling slot by slot,
// its bytes measured on the cache tensors against the formula 2 x layers x kv-heads x head-dim x
// tokens x bytes, and what int8 / int4 caches would hold.
import { postJSON, el, tokenPreview, formatBytes } from "./api.js";
import { sequential } from "./draw.js";

export async function generateView(section, model) {
  const translation = model.kind === "translation";
  const text = el("textarea", { id: "gen-text", rows: 2, spellcheck: "false" },
    translation ? model.default_text : model.default_text.split("\n")[0]);
  const chips = el("div", { class: "chips" });
  const count = el("span", { class: "count", id: "gen-count" });
  const message = el("div", { class: "message", id: "gen-message" });
  const steps = el("input", { type: "number", id: "gen-steps", min: 1, max: 64, value: 16 });
  const topK = el("input", { type: "number", id: "gen-topk", min: 1, max: 20, value: 5 });
  const temperature = el("input", { type: "number", id: "gen-temperature", min: 0, max: 5, step: 0.1, value: 0 });
  const seed = el("input", { type: "number", id: "gen-seed", min: 0, value: 0 });
  const chat = model.chat ? el("input", { type: "checkbox", id: "gen-chat" }) : null;
  const runButton = el("button", { id: "gen-run" }, "Decode");
  const result = el("div", { id: "gen-result", hidden: true });

  section.replaceChildren(
    el("h2", {}, "Generation step by step, and the KV cache"),
    el("p", { class: "lead" }, (translation
      ? "The source is encoded once; the decoder starts from <s> and feeds one token per step. "
      : "The prompt is fed in one step (prefill), then one token per step. ") +
      "Each step keeps the keys and values of the tokens it fed in a preallocated cache, so later steps " +
      "compute attention for the new token only. Step through to watch the cache of every layer fill."),
    el("div", { class: "panel" },
      el("label", { for: "gen-text" }, translation ? "Source sentence" : "Prompt"), text,
      el("div", { class: "controls" }, count,
        el("label", {}, "steps ", steps), el("label", {}, "top-k ", topK),
        el("label", { title: "0 = greedy" }, "temperature ", temperature), el("label", {}, "seed ", seed),
        chat ? el("label", {}, chat, " chat template") : null, runButton),
      chips, message),
    result);

  tokenPreview({ input: text, chips, count, message, onState: (ok) => { runButton.disabled = !ok; } });

  let data = null;
  let index = 0;

  const stepLabel = el("span", { id: "gen-step-label", class: "count" });
  const slider = el("input", { type: "range", id: "gen-slider", min: 0, max: 0, value: 0 });
  const go = (i) => { if (data) { index = Math.max(0, Math.min(data.steps.length - 1, i)); render(); } };
  const bar = el("div", { class: "steps-bar" },
    el("button", { class: "ghost", id: "gen-first", onclick: () => go(0) }, "« first"),
    el("button", { class: "ghost", id: "gen-prev", onclick: () => go(index - 1) }, "◀ step"),
    stepLabel,
    el("button", { class: "ghost", id: "gen-next", onclick: () => go(index + 1) }, "step ▶"),
    el("button", { class: "ghost", id: "gen-last", onclick: () => go(data.steps.length - 1) }, "last »"),
    slider);
  slider.addEventListener("input", () => go(Number(slider.value)));
  document.addEventListener("keydown", (event) => {  // ← → step through, while this view is shown
    if (section.hidden || event.target.tagName === "TEXTAREA" || event.target.tagName === "INPUT") return;
    if (event.key === "ArrowRight") go(index + 1);
    if (event.key === "ArrowLeft") go(index - 1);
  });
  const sequence = el("div", { id: "gen-seq" });
  const topTable = el("table", { class: "topk", id: "gen-topk-table" });
  const stepNote = el("div", { class: "note", id: "gen-step-note" });
  const bytes = el("table", { class: "kv-bytes", id: "gen-bytes" });
  const kv = el("div", { class: "kv-wrap", id: "gen-kv" });
  const kvTitle = el("h3", { id: "gen-kv-title" });
  result.append(el("div", { class: "panel" }, bar,
    el("div", { class: "row" },
      el("div", { class: "col" }, el("h3", {}, "Sequence"), sequence,
        el("h3", { id: "gen-topk-title" }, "Next-token probabilities"), topTable, stepNote),
      el("div", { class: "col" }, kvTitle, bytes, kv))));

  function chipRow(labels, cls) { return labels.map((l) => el("span", { class: `chip ${cls}` }, l)); }

  function render() {
    const step = data.steps[index];
    slider.value = String(index);
    stepLabel.textContent = `step ${index + 1} of ${data.steps.length}`;
    // the sequence: what was fed, what was generated so far, this step's token
    const generated = data.steps.slice(0, index).map((s) => s.label);
    if (translation) {
      sequence.replaceChildren(el("div", { class: "note" }, "source (encoded once)"),
        el("div", { class: "chips" }, chipRow(data.source.labels, "fed")),
        el("div", { class: "note" }, "target"),
        el("div", { class: "chips", id: "gen-seq-chips" }, chipRow(data.fed_first, "fed"), chipRow(generated, "gen"),
          el("span", { class: "chip current", id: "gen-current" }, step.label)));
    } else {
      sequence.replaceChildren(el("div", { class: "chips", id: "gen-seq-chips" }, chipRow(data.prompt.labels, "fed"),
        chipRow(generated, "gen"), el("span", { class: "chip current", id: "gen-current" }, step.label)));
    }
    document.getElementById("gen-topk-title").textContent = `Next-token probabilities at step ${index + 1}`;
    const best = step.top[0].p;
    topTable.replaceChildren(...step.top.map((t, rank) => el("tr", { class: t.id === step.id ? "chosen" : null },
      el("td", {}, String(rank + 1)), el("td", {}, t.label), el("td", {}, `${(100 * t.p).toFixed(2)}%`),
      el("td", { style: "width:45%" }, el("div", { class: "bar", style: `width:${(100 * t.p) / best}%` })))));
    const inTop = step.top.some((t) => t.id === step.id);
    stepNote.textContent = `${data.sampling ? "sampled" : "greedy (the most likely token)"}: ${step.label} with ` +
      `p = ${(100 * step.p).toFixed(2)}%${inTop ? "" : " (outside the top-k)"}; ${step.ms} ms for this step` +
      (step.eos ? "; end of text: decoding stops" : "");
    renderCache(step);
  }

  function renderCache(step) {
    const c = data.cache;
    const fig = step.cache;
    const previous = index > 0 ? data.steps[index - 1].cache.filled : 0;
    kvTitle.textContent = `KV cache after step ${index + 1}: ${fig.filled} of ${c.capacity} slots filled ` +
      "(this step's token is written at the next step)";
    const unit = c.bytes_per_value;
    const formula = `2 × ${c.layers} layers × ${c.kv_heads} kv heads × ${c.head_dim} head_dim × ${fig.filled} tokens × ${unit} B`;
    const equal = fig.measured === fig.formula;
    const save = (x) => (x === null ? "" : ` (${(100 * (1 - x / fig.formula)).toFixed(0)}% less)`);
    const rows = [
      ["measured", `filled slots of the cache tensors (${c.dtype})`, fig.measured, ""],
      ["formula", formula, fig.formula, equal ? "✓ equal" : "✗ differs"],
      ["int8", "int8 cache: 1 B a value + a float16 scale per token and head", fig.int8, save(fig.int8)],
      ["int4", "int4 cache: ½ B a value + a float16 scale per token and head", fig.int4, save(fig.int4)],
      ["allocated", `allocated up front for ${c.capacity} slots`, c.allocated, ""],
    ];
    if (c.kv_heads !== c.heads) {
      rows.push(["mha", `multi-head attention (${c.heads} kv heads) would need`, (fig.formula * c.heads) / c.kv_heads,
        `GQA saves ${(100 * (1 - c.kv_heads / c.heads)).toFixed(0)}%`]);
    }
    if (c.cross) {
      rows.push(["cross", `cross-attention k/v: ${c.cross.slots} source slots × ${c.layers} layers, computed once`,
        c.cross.measured, c.cross.measured === c.cross.formula ? "✓ = formula" : "✗ differs"]);
    }
    bytes.replaceChildren(el("tr", {}, el("th", {}, ""), el("th", {}, "bytes"), el("th", {}, "")),
      ...rows.map(([field, what, n, extra]) => el("tr", { "data-field": field },
        el("td", {}, what), el("td", { class: "num", "data-value": n }, `${formatBytes(n)} (${Number(n).toLocaleString("en")} B)`),
        el("td", { class: extra.startsWith("✓") ? "ok" : "" }, extra))));
    const lines = [];
    for (let l = 0; l < c.layers; l += 1) {
      const norms = c.slot_norms[l];
      let top = 0;
      for (const v of norms) top = Math.max(top, v);
      const slots = [];
      for (let s = 0; s < c.capacity; s += 1) {
        const filled = s < fig.filled;
        const cls = `kv-slot${filled ? " filled" : ""}${filled && s >= previous ? " new" : ""}`;
        const style = filled ? `background:rgb(${sequential(0.15 + 0.85 * (norms[s] / (top || 1))).map(Math.round)})` : null;
        slots.push(el("span", { class: cls, style, title: filled ? `layer ${l}, slot ${s}: |k| = ${norms[s].toFixed(3)}` : `slot ${s}: empty` }));
      }
      lines.push(el("div", { class: "kv-row", "data-layer": l }, el("span", { class: "lab" }, `self L${l}`), slots));
    }
    if (c.cross) {
      for (let l = 0; l < c.layers; l += 1) {
        const slots = [];
        for (let s = 0; s < c.cross.slots; s += 1) slots.push(el("span", { class: "kv-slot cross", title: `source token ${s}` }));
        lines.push(el("div", { class: "kv-row cross-row" }, el("span", { class: "lab" }, `cross L${l}`), slots));
      }
    }
    kv.replaceChildren(el("div", { class: "note" }, "each row a layer, each cell a token's slot (colour: the length of its key); " +
      "outlined: written at this step"), ...lines);
  }

  async function run() {
    message.textContent = "";
    runButton.disabled = true;
    runButton.classList.add("spinner");
    try {
      data = await postJSON("/api/generate", { text: text.value, steps: Number(steps.value), top_k: Number(topK.value),
        temperature: Number(temperature.value), seed: Number(seed.value), chat: chat ? chat.checked : false });
      slider.max = String(data.steps.length - 1);
      result.hidden = false;
      index = 0;
      render();
    } catch (err) {
      message.textContent = err.message;
    } finally {
      runButton.disabled = false;
      runButton.classList.remove("spinner");
    }
  }
  runButton.addEventListener("click", run);
  await run();
}
