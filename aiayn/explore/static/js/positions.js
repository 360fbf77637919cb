// View 4: positions. The paper's sinusoidal encoding, PE(t)·PE(t+k) against k (it depends only on
// the offset k), RoPE's rotations (the rotated q·k depends only on the offset too), and the loaded
// model's own scheme (GET /api/positions).
import { getJSON, unpack, el, svgEl, showTip } from "./api.js";
import { heatmap, diverging, lineChart, legend, extent } from "./draw.js";

function curves(dots, label) {
  return dots.curves.map((c, n) => ({ name: `t = ${c.start}`, dashed: n > 0, width: n === 0 ? 3 : 1.6,
    points: c.values.map((v, k) => [dots.offsets[k], v]), label }));
}

// A (P, d) table as a heatmap: positions down, dimensions across, hover for the value.
function tableMap(packed, { id, rowName = "position", colName = "dimension", lo = -1, hi = 1, color = diverging, maxPx = 640 }) {
  const m = unpack(packed);
  const [rows, cols] = m.shape;
  const cell = Math.max(1, Math.min(6, Math.floor(maxPx / cols)));
  const readout = el("div", { class: "readout" }, "hover for a value");
  const canvas = heatmap(m.values, rows, cols, { cell, color, lo, hi, onHover: (i, j, v, event) => {
    const line = `${rowName} ${i}, ${colName} ${j}: ${v.toFixed(4)}`;
    readout.textContent = line;
    showTip(event, line);
  } });
  canvas.id = id;
  canvas.style.width = `${Math.min(maxPx, Math.max(cols * cell, 360))}px`;
  canvas.style.height = `${Math.min(Math.max(rows * cell, 200), 420)}px`;
  return el("div", {}, el("div", { class: "note" }, `${rows} ${rowName}s (down) × ${cols} ${colName}s (across)`),
    canvas, readout);
}

// RoPE as rotations: for a few pairs of dimensions, where positions 0..11 turn a unit vector.
function ropeClocks(theta, id) {
  const pairs = [...new Set([0, 1, Math.floor(theta.length / 4), Math.floor(theta.length / 2), theta.length - 1])];
  const r = 42;
  const w = 140;
  const svg = svgEl("svg", { width: pairs.length * w, height: 132, id, class: "chart" });
  pairs.forEach((i, n) => {
    const cx = w / 2 + n * w;
    const cy = 62;
    svg.append(svgEl("circle", { cx, cy, r, fill: "none", stroke: "#d9dce1" }));
    for (let pos = 0; pos < 12; pos += 1) {
      const a = pos * theta[i];
      const x = cx + r * Math.cos(a);
      const y = cy - r * Math.sin(a);
      svg.append(svgEl("line", { x1: cx, y1: cy, x2: x, y2: y, stroke: "#2563eb", "stroke-opacity": 1 - pos / 13 }),
        svgEl("circle", { cx: x, cy: y, r: 3, fill: "#2563eb", "fill-opacity": 1 - pos / 13 },
          svgEl("title", {}, `pair ${i}, position ${pos}: angle ${a.toFixed(3)} rad`)));
    }
    svg.append(svgEl("text", { x: cx, y: 124, "text-anchor": "middle", style: "font-size:11px" },
      `pair ${i}: θ = ${theta[i].toPrecision(2)}`));
  });
  return el("div", {}, el("div", { class: "note" }, "each pair is rotated by θ_i per position (positions 0 to 11, fading):"),
    svg);
}

function chartPanel(title, dots, yLabel, id) {
  const series = curves(dots);
  const chart = lineChart(series, { xLabel: "offset k", yLabel, width: 520, height: 250 });
  chart.id = id;
  // How far the curves of the different starts t lie apart (0: the value depends on k alone).
  let gap = 0;
  let size = 0;
  for (const c of dots.curves) {
    c.values.forEach((v, k) => {
      gap = Math.max(gap, Math.abs(v - dots.curves[0].values[k]));
      size = Math.max(size, Math.abs(v));
    });
  }
  const verdict = gap <= 1e-4 * Math.max(size, 1) ? "they lie on top of each other" : "they differ";
  return el("div", { class: "col" }, el("h3", {}, title), chart, legend(series),
    el("div", { class: "note offset-gap", "data-gap": gap }, `largest gap between the curves: ${gap.toExponential(1)} ` +
      `(${verdict})`));
}

export async function positionsView(section, model) {
  section.replaceChildren(el("h2", {}, "Positions"), el("p", { class: "note spinner" }, "computing"));
  const data = await getJSON("/api/positions");
  const s = data.sinusoidal;
  const rope = data.rope;
  const own = data.model;
  const children = [
    el("h2", {}, "Positions"),
    el("p", { class: "lead" }, "Attention itself ignores order: a model learns it from positions added to the " +
      "embeddings (sinusoidal, learned), rotated into queries and keys (RoPE) or added to the attention scores " +
      "(ALiBi, T5). Below: the paper's encoding, RoPE, and this model's own."),
    el("div", { class: "panel", id: "pos-sinusoidal" },
      el("h3", {}, `Sinusoidal encoding (paper §3.5), d_model ${s.d_model}`),
      el("p", { class: "note" }, "PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)): " +
        "each pair of dimensions turns at its own frequency, fast on the left, slow on the right."),
      el("div", { class: "row" },
        el("div", { class: "col" }, tableMap(s.table, { id: "pos-sin-table" })),
        chartPanel("PE(t) · PE(t + k) depends only on k", s.dots, "PE(t)·PE(t+k)", "pos-sin-dots"))),
    el("div", { class: "panel", id: "pos-rope" },
      el("h3", {}, `RoPE: rotary position embedding (head_dim ${rope.head_dim}, base ${rope.base})`),
      el("p", { class: "note" }, "Each pair (x_i, x_{i+d/2}) of a query and a key is rotated by the angle pos × θ_i, " +
        "θ_i = base^(−2i/d). The map shows cos(pos × θ_i); the curves, one random q and k rotated to positions t and " +
        "t + k: their dot product depends only on the offset k."),
      ropeClocks(rope.theta, "pos-rope-clocks"),
      el("div", { class: "row" },
        el("div", { class: "col" }, tableMap(rope.cos, { id: "pos-rope-cos", colName: "pair" })),
        chartPanel("rotated q(t) · k(t + k) depends only on k", rope.dots, "q·k", "pos-rope-dots"))),
    ownPanel(own, model),
  ];
  section.replaceChildren(...children);
}

function ownPanel(own, model) {
  const panel = el("div", { class: "panel", id: "pos-model", "data-scheme": own.scheme },
    el("h3", {}, `This model: ${own.title}`));
  if (own.scheme === "sinusoidal") {
    panel.append(el("div", { class: "row" },
      el("div", { class: "col" }, tableMap(own.table, { id: "pos-own-table" })),
      chartPanel("its PE(t) · PE(t + k)", own.dots, "PE(t)·PE(t+k)", "pos-own-dots")));
  } else if (own.scheme === "learned") {
    // A learned table has a few outlying values: colour by the 99th percentile of |value|.
    const sorted = Float32Array.from(unpack(own.table).values, Math.abs).sort();
    const bound = sorted[Math.floor(0.99 * (sorted.length - 1))] || 1;
    panel.append(el("p", { class: "note" }, "A vector per position, trained with the model. The similarity map " +
      "(cosine of every pair of positions) shows what it learned about distance; the curves compare positions t " +
      "and t + k: unlike the sinusoids they need not depend on k alone."),
    el("div", { class: "row" },
      el("div", { class: "col" }, el("h3", {}, "the table"), tableMap(own.table, { id: "pos-own-table", lo: -bound, hi: bound })),
      el("div", { class: "col" }, el("h3", {}, "cosine similarity of positions"),
        tableMap(own.similarity, { id: "pos-own-similarity", colName: "position", maxPx: 420 }))),
    el("div", { class: "row" }, chartPanel("cos(p(t), p(t + k))", own.dots, "cosine", "pos-own-dots")));
  } else if (own.scheme === "rope") {
    panel.append(el("p", { class: "note" }, `${model.name} rotates its queries and keys (no position is added to the ` +
      "embeddings); these are its own tables and base."), ropeClocks(own.theta, "pos-own-clocks"),
    el("div", { class: "row" },
      el("div", { class: "col" }, tableMap(own.cos, { id: "pos-own-table", colName: "pair" })),
      chartPanel("its rotated q(t) · k(t + k)", own.dots, "q·k", "pos-own-dots")));
  } else if (own.bias) {
    const b = unpack(own.bias);
    const [h, t] = b.shape;
    const [lo, hi] = extent(b.values);
    const row = el("div", { class: "row" });
    for (let head = 0; head < h; head += 1) {
      const canvas = heatmap(b.values.subarray(head * t * t, (head + 1) * t * t), t, t,
        { cell: 3, lo, hi, color: diverging });
      row.append(el("div", {}, el("div", { class: "note" }, `head ${head}`), canvas));
    }
    panel.append(el("p", { class: "note" }, `added to the attention scores; colours from ${lo.toFixed(2)} to ${hi.toFixed(2)}`), row);
  } else {
    panel.append(el("p", { class: "note" }, "nothing to draw"));
  }
  return panel;
}
