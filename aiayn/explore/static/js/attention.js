// View 1: tokens and attention. A layers x heads overview (each layer fetched when its row comes
// into view: POST /api/attention runs the model once, GET /api/attention/{key}/{stack}/{layer}
// serves one layer's (h, t_q, t_k) weights) and one head in detail: a heatmap with the exact
// value under the mouse, and lines between tokens.
import { postJSON, getJSON, unpack, el, svgEl, tokenPreview, showTip } from "./api.js";
import { heatmap, labelledHeatmap, paintMatrix, sequential } from "./draw.js";

const CONCURRENT = 2; // layer requests in flight at once
const LINES_MAX = 80; // the lines view is drawn up to this many tokens a side

export async function attentionView(section, model) {
  const translation = model.kind === "translation";
  const state = { probe: null, stack: null, selected: { layer: 0, head: 0 }, layers: new Map(), queue: [],
    active: 0, generation: 0, observer: null };

  const text = el("textarea", { id: "attn-text", rows: 2, spellcheck: "false",
    placeholder: model.kind === "task" ? "the task's input (empty: a test example)" : null }, model.default_text);
  const chips = el("div", { class: "chips", id: "attn-chips" });
  const count = el("span", { class: "count", id: "attn-count" });
  const message = el("div", { class: "message", id: "attn-message" });
  const show = el("button", { id: "attn-show" }, "Show attention");
  const target = translation ? el("textarea", { id: "attn-target", rows: 1, spellcheck: "false",
    placeholder: "blank: the model's own greedy translation" }) : null;
  const targetChips = el("div", { class: "chips", id: "attn-target-chips" });
  const targetCount = el("span", { class: "count" });
  const targetMessage = el("div", { class: "message", id: "attn-target-message" });
  const note = el("div", { class: "note", id: "attn-note" });
  const stacks = el("div", { class: "tabs2", id: "attn-stacks" });
  const gridInfo = el("div", { class: "note", id: "attn-grid-info", style: "max-width: 560px" });
  const grid = el("div", { class: "head-grid", id: "attn-grid" });
  const gridWrap = el("div", { class: "grid-wrap", id: "attn-grid-wrap" }, grid);
  const detailTitle = el("h3", { id: "attn-detail-title" });
  const readout = el("div", { class: "readout", id: "attn-hover" }, "hover over the heatmap for a value");
  const heat = el("div", { id: "attn-heat" });
  const lines = el("div", { class: "lines", id: "attn-lines" });
  const scale = el("input", { type: "checkbox", id: "attn-absolute" });
  const okState = { source: true, target: true };
  const refreshButton = () => { show.disabled = !(okState.source && okState.target); };

  section.replaceChildren(
    el("h2", {}, "Tokens and attention"),
    el("p", { class: "lead" }, model.kind === "task"
      ? "This run's task reads its own input syntax (see its attention example); leave the box empty for a test example."
      : "Type a text: the model runs once with need_weights=True and every head's attention weights come back, " +
        "one layer at a time as you scroll. Rows of a map are queries, columns keys; each row sums to 1." +
        (translation ? " The decoder's cross-attention shows target queries against source keys." : "")),
    el("div", { class: "panel" },
      el("label", { for: "attn-text" }, translation ? "Source sentence" : "Text"), text,
      el("div", { class: "controls" }, count, show), chips, message,
      translation ? [el("label", { for: "attn-target" }, "Target (optional)"), target,
        el("div", { class: "controls" }, targetCount), targetChips, targetMessage] : null),
    note, stacks,
    el("div", { class: "row" },
      el("div", { class: "col", style: "flex:0 1 auto" }, el("h3", {}, "Layers × heads"), gridInfo,
        el("div", { class: "controls" }, el("label", {}, scale, " linear colour scale 0 – 1 (else √(weight / the map's largest))")),
        gridWrap),
      el("div", { class: "col" }, detailTitle, readout, el("div", { class: "detail" }, heat, lines))));

  if (model.kind !== "task") {
    tokenPreview({ input: text, chips, count, message, onState: (ok) => { okState.source = ok; refreshButton(); } });
  }
  if (target) {
    tokenPreview({ input: target, chips: targetChips, count: targetCount, message: targetMessage, side: "target",
      onState: (ok) => { okState.target = ok || target.value.trim() === ""; refreshButton(); } });
  }

  // ---- fetching layers, a few at a time --------------------------------------------------------
  function layer(stack, index) {
    const key = `${stack}/${index}`;
    if (!state.layers.has(key)) {
      const probeKey = state.probe.key;
      state.layers.set(key, new Promise((resolve, reject) => {
        state.queue.push({ url: `/api/attention/${probeKey}/${stack}/${index}`, resolve, reject, key });
        pump();
      }));
    }
    return state.layers.get(key);
  }

  function pump() {
    while (state.active < CONCURRENT && state.queue.length) {
      const job = state.queue.shift();
      state.active += 1;
      getJSON(job.url).then((r) => job.resolve(unpack(r.weights)), (err) => {
        state.layers.delete(job.key);
        job.reject(err);
      }).finally(() => { state.active -= 1; pump(); });
    }
  }

  // ---- the overview grid -------------------------------------------------------------------------
  function buildGrid(desc) {
    if (state.observer) state.observer.disconnect();
    const heads = desc.heads;
    const kv = desc.name !== "task" ? model.kv_heads : heads;
    const perGroup = heads / kv;
    const grouped = kv < heads;
    gridInfo.textContent = grouped
      ? `Grouped-query attention: ${heads} query heads share ${kv} key/value heads, ${perGroup} per group ` +
        "(the columns between the gaps read the same keys and values)."
      : `${desc.layers} layers × ${heads} heads; every head has its own keys and values.`;
    let columns = "40px";
    for (let g = 0; g < kv; g += 1) columns += ` repeat(${perGroup}, 56px)${g < kv - 1 && grouped ? " 8px" : ""}`;
    grid.style.gridTemplateColumns = columns;
    const cells = [el("div")];
    const sep = () => (grouped ? el("div", { class: "gsep" }) : null);
    if (grouped) {
      for (let g = 0; g < kv; g += 1) {
        cells.push(el("div", { class: "ghead kv-group", style: `grid-column: span ${perGroup}` }, `kv head ${g}`));
        if (g < kv - 1) cells.push(sep());
      }
      cells.push(el("div"));
    }
    for (let h = 0; h < heads; h += 1) {
      cells.push(el("div", { class: "ghead" }, `h${h}`));
      if (grouped && (h + 1) % perGroup === 0 && h < heads - 1) cells.push(sep());
    }
    const rows = [];
    for (let l = 0; l < desc.layers; l += 1) {
      const label = el("div", { class: "lab", "data-layer": l }, `L${l}`);
      cells.push(label);
      rows.push(label);
      for (let h = 0; h < heads; h += 1) {
        cells.push(el("canvas", { class: "head-cell", width: 1, height: 1, "data-layer": l, "data-head": h,
          "data-loaded": "0", title: `layer ${l}, head ${h}`, onclick: () => select(l, h) }));
        if (grouped && (h + 1) % perGroup === 0 && h < heads - 1) cells.push(sep());
      }
    }
    grid.replaceChildren(...cells.filter(Boolean));
    const generation = state.generation;
    state.observer = new IntersectionObserver((entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) continue;
        state.observer.unobserve(entry.target);
        const l = Number(entry.target.dataset.layer);
        layer(desc.name, l).then((w) => {
          if (generation === state.generation) paintRow(desc, l, w);
        }, (err) => { message.textContent = err.message; });
      }
    }, { root: gridWrap, rootMargin: "60px" });
    for (const row of rows) state.observer.observe(row);
  }

  function paintRow(desc, l, w) {
    const [h, tq, tk] = w.shape;
    for (let head = 0; head < h; head += 1) {
      const canvas = grid.querySelector(`canvas[data-layer="${l}"][data-head="${head}"]`);
      if (!canvas) continue;
      const values = w.values.subarray(head * tq * tk, (head + 1) * tq * tk);
      paintMatrix(canvas, values, tq, tk, colourScale(values));
      canvas.dataset.loaded = "1";
    }
  }

  // Colours: linear over [0, 1], or (default) the square root of weight / the map's largest weight,
  // so that weights spread over many keys stay visible next to a few large ones. Values shown are exact.
  function colourScale(values) {
    if (scale.checked) return { lo: 0, hi: 1 };
    let m = 0;
    for (const v of values) if (v > m) m = v;
    const top = m > 0 ? m : 1;
    return { lo: 0, hi: 1, color: (x) => sequential(Math.sqrt(Math.max(0, x) / top)) };
  }
  scale.addEventListener("change", () => { if (state.probe) chooseStack(state.stack.name); });

  // ---- one head in detail ------------------------------------------------------------------------
  async function select(l, h) {
    state.selected = { layer: l, head: h };
    for (const c of grid.querySelectorAll("canvas.selected")) c.classList.remove("selected");
    const cell = grid.querySelector(`canvas[data-layer="${l}"][data-head="${h}"]`);
    if (cell) cell.classList.add("selected");
    const desc = state.stack;
    const generation = state.generation;
    detailTitle.textContent = `${desc.title}: layer ${l}, head ${h}` +
      (model.kv_heads < model.heads && desc.name !== "task" ? ` (kv head ${Math.floor(h / (model.heads / model.kv_heads))})` : "");
    let w;
    try {
      w = await layer(desc.name, l);
    } catch (err) {
      message.textContent = err.message;
      return;
    }
    if (generation !== state.generation) return;
    const [, tq, tk] = w.shape;
    const values = w.values.subarray(h * tq * tk, (h + 1) * tq * tk);
    const qLabels = state.probe.tokens[desc.queries];
    const kLabels = state.probe.tokens[desc.keys];
    const size = Math.max(3, Math.min(26, Math.floor(560 / Math.max(tq, tk))));
    const canvas = heatmap(values, tq, tk, {
      cell: size, title: `${tq} queries × ${tk} keys`, ...colourScale(values),
      onHover: (i, j, v, event) => {
        const line = `query ${i} ${qLabels[i]} → key ${j} ${kLabels[j]}: ${v.toFixed(4)}`;
        readout.textContent = line;
        Object.assign(readout.dataset, { value: String(v), query: String(i), key: String(j) });
        markChips(desc, i, j);
        showTip(event, line);
      },
    });
    canvas.id = "attn-heatmap";
    canvas.dataset.queries = String(tq);
    canvas.dataset.keys = String(tk);
    heat.replaceChildren(labelledHeatmap(canvas, kLabels, qLabels, size));
    lines.replaceChildren(tq <= LINES_MAX && tk <= LINES_MAX ? linesView(values, tq, tk, qLabels, kLabels)
      : el("p", { class: "note" }, `the lines view draws up to ${LINES_MAX} tokens a side`));
  }

  // The hovered cell's query and key among the token chips above.
  function markChips(desc, i, j) {
    const rows = { source: chips, tokens: chips, target: targetChips };
    for (const c of section.querySelectorAll(".chip.hl")) c.classList.remove("hl");
    const q = rows[desc.queries] && rows[desc.queries].children[i];
    const k = rows[desc.keys] && rows[desc.keys].children[j];
    if (q) q.classList.add("hl");
    if (k) k.classList.add("hl");
  }

  function linesView(values, tq, tk, qLabels, kLabels) {
    const rowH = 17;
    const width = 380;
    const height = Math.max(tq, tk) * rowH + 24;
    const left = 150;
    const right = width - 150;
    const svg = svgEl("svg", { width, height, id: "attn-lines-svg" });
    svg.append(svgEl("text", { x: left, y: 12, "text-anchor": "end", fill: "#6b7280" }, "queries"),
      svgEl("text", { x: right, y: 12, fill: "#6b7280" }, "keys"));
    const groups = [];
    for (let i = 0; i < tq; i += 1) {
      const g = svgEl("g", { "data-query": i });
      for (let j = 0; j < tk; j += 1) {
        const w = values[i * tk + j];
        if (w < 0.02) continue;
        g.append(svgEl("line", { x1: left + 4, y1: 24 + i * rowH - 4, x2: right - 4, y2: 24 + j * rowH - 4,
          stroke: "#2563eb", "stroke-width": 1 + 3 * w, "stroke-opacity": w }));
      }
      groups.push(g);
      svg.append(g);
    }
    const focus = (i) => groups.forEach((g, k) => g.setAttribute("opacity", i === null || k === i ? 1 : 0.06));
    qLabels.forEach((label, i) => {
      const t = svgEl("text", { x: left, y: 24 + i * rowH, "text-anchor": "end" }, label);
      t.addEventListener("mouseenter", () => focus(i));
      t.addEventListener("mouseleave", () => focus(null));
      svg.append(t);
    });
    kLabels.forEach((label, j) => svg.append(svgEl("text", { x: right, y: 24 + j * rowH }, label)));
    return svg;
  }

  // ---- running a text ----------------------------------------------------------------------------
  function chooseStack(name) {
    state.stack = state.probe.stacks.find((s) => s.name === name) || state.probe.stacks[0];
    for (const b of stacks.querySelectorAll("button")) b.classList.toggle("active", b.dataset.stack === state.stack.name);
    buildGrid(state.stack);
    const { layer: l, head: h } = state.selected;
    select(Math.min(l, state.stack.layers - 1), Math.min(h, state.stack.heads - 1));
  }

  async function run() {
    message.textContent = "";
    show.classList.add("spinner");
    show.disabled = true;
    try {
      const payload = { text: text.value };
      if (target && target.value.trim()) payload.target = target.value;
      const probe = await postJSON("/api/attention", payload);
      state.generation += 1;
      state.probe = probe;
      state.layers.clear();
      state.queue.length = 0;
      note.textContent = probe.note || "";
      if (translation) {
        chips.replaceChildren(...probe.tokens.source.map((l) => el("span", { class: "chip" }, l)));
        targetChips.replaceChildren(...probe.tokens.target.map((l) => el("span", { class: "chip" }, l)));
      }
      stacks.replaceChildren(...probe.stacks.map((s) => el("button", { "data-stack": s.name,
        onclick: () => chooseStack(s.name) }, `${s.title} (${s.shape[0]}×${s.shape[1]})`)));
      chooseStack(state.stack ? state.stack.name : probe.stacks[probe.stacks.length > 1 ? 2 : 0].name);
    } catch (err) {
      message.textContent = err.message;
    } finally {
      show.classList.remove("spinner");
      refreshButton();
    }
  }

  show.addEventListener("click", run);
  await run();
}
