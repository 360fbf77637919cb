// Drawing: colour maps, heatmaps on a canvas, line charts in SVG.
import { el, svgEl, showTip, hideTip } from "./api.js";

// Sequential map for weights in [0, 1] (a viridis approximation, 9 stops).
const VIRIDIS = [[68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [109, 205, 89], [253, 231, 37]];

function interpolate(stops, x) {
  const t = Math.min(1, Math.max(0, x)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(t));
  const f = t - i;
  const a = stops[i];
  const b = stops[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

export function sequential(x) { return interpolate(VIRIDIS, x); }

// Diverging map for values in [-1, 1]: blue, white, red.
export function diverging(x) {
  const v = Math.min(1, Math.max(-1, x));
  return v < 0 ? [255 + (59 - 255) * -v, 255 + (76 - 255) * -v, 255 + (192 - 255) * -v]
    : [255 + (180 - 255) * v, 255 + (4 - 255) * v, 255 + (38 - 255) * v];
}

// values (rows x cols, row-major) onto `canvas` at one pixel per cell; CSS scales it up.
export function paintMatrix(canvas, values, rows, cols, { color = sequential, lo = 0, hi = 1 } = {}) {
  canvas.width = cols;
  canvas.height = rows;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(cols, rows);
  const span = hi - lo || 1;
  for (let i = 0; i < rows * cols; i += 1) {
    const x = (values[i] - lo) / span;
    const [r, g, b] = color === diverging ? diverging(x * 2 - 1) : color(x);
    image.data[4 * i] = r;
    image.data[4 * i + 1] = g;
    image.data[4 * i + 2] = b;
    image.data[4 * i + 3] = 255;
  }
  ctx.putImageData(image, 0, 0);
}

// A heatmap with optional hover: `onHover(i, j, value, event)` for the cell under the mouse.
export function heatmap(values, rows, cols, { cell = 4, color, lo, hi, onHover, title } = {}) {
  const canvas = el("canvas", { class: "heat", title });
  paintMatrix(canvas, values, rows, cols, { color, lo, hi });
  canvas.style.width = `${cols * cell}px`;
  canvas.style.height = `${rows * cell}px`;
  if (onHover) {
    canvas.addEventListener("mousemove", (event) => {
      const box = canvas.getBoundingClientRect();
      const j = Math.floor(((event.clientX - box.left) / box.width) * cols);
      const i = Math.floor(((event.clientY - box.top) / box.height) * rows);
      if (i >= 0 && i < rows && j >= 0 && j < cols) onHover(i, j, values[i * cols + j], event);
    });
    canvas.addEventListener("mouseleave", () => hideTip());
  }
  return canvas;
}

// The extent of some numbers, ignoring non-finite ones.
export function extent(numbers) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const x of numbers) {
    if (!Number.isFinite(x)) continue;
    if (x < lo) lo = x;
    if (x > hi) hi = x;
  }
  return lo === Infinity ? [0, 1] : [lo, hi === lo ? lo + 1 : hi];
}

const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

// A line chart: series = [{name, points: [[x, y], ...], dashed, dots}]; returns an <svg>.
export function lineChart(series, { width = 520, height = 240, xLabel = "", yLabel = "", logY = false } = {}) {
  const pad = { left: 62, right: 12, top: 12, bottom: 38 };
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const tr = (y) => (logY ? Math.log10(Math.max(y, 1e-12)) : y);
  const ys = series.flatMap((s) => s.points.map((p) => tr(p[1])));
  const [x0, x1] = extent(xs);
  const [y0, y1] = extent(ys);
  const px = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const py = (y) => height - pad.bottom - ((tr(y) - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  const svg = svgEl("svg", { class: "chart", width, height, viewBox: `0 0 ${width} ${height}` });
  for (let k = 0; k <= 4; k += 1) {
    const yv = y0 + ((y1 - y0) * k) / 4;
    const y = height - pad.bottom - (k / 4) * (height - pad.top - pad.bottom);
    svg.append(svgEl("line", { class: "grid", x1: pad.left, x2: width - pad.right, y1: y, y2: y }));
    const shown = logY ? 10 ** yv : yv;
    svg.append(svgEl("text", { x: pad.left - 6, y: y + 4, "text-anchor": "end" }, formatTick(shown)));
  }
  for (let k = 0; k <= 4; k += 1) {
    const raw = x0 + ((x1 - x0) * k) / 4;
    const xv = x1 - x0 > 20 ? Math.round(raw) : raw;  // steps and offsets: whole numbers
    svg.append(svgEl("text", { x: px(xv), y: height - pad.bottom + 15, "text-anchor": "middle" }, formatTick(xv)));
  }
  svg.append(svgEl("line", { class: "axis", x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom }));
  svg.append(svgEl("line", { class: "axis", x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom }));
  svg.append(svgEl("text", { x: (width + pad.left) / 2, y: height - 4, "text-anchor": "middle" }, xLabel));
  svg.append(svgEl("text", { x: 12, y: pad.top + (height - pad.top - pad.bottom) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${pad.top + (height - pad.top - pad.bottom) / 2})` }, yLabel));
  series.forEach((s, n) => {
    const colour = s.color || PALETTE[n % PALETTE.length];
    const pts = s.points.filter((p) => Number.isFinite(tr(p[1])));
    const line = svgEl("polyline", { class: "series", "data-name": s.name, "data-points": pts.length, fill: "none",
      stroke: colour, "stroke-width": s.width || 1.6, "stroke-dasharray": s.dashed ? "5 4" : null,
      points: pts.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ") });
    svg.append(line);
    if (s.dots || pts.length === 1) {
      for (const p of pts) {
        svg.append(svgEl("circle", { cx: px(p[0]), cy: py(p[1]), r: 3, fill: colour },
          svgEl("title", {}, `${s.name}: step ${p[0]}, ${formatTick(p[1])}`)));
      }
    }
  });
  return svg;
}

export function legend(series) {
  return el("div", { class: "legend" }, series.map((s, n) => el("span", {},
    el("i", { style: `background:${s.color || PALETTE[n % PALETTE.length]}` }), s.name)));
}

export function formatTick(v) {
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  if (Number.isInteger(v)) return String(v);
  return a < 1 ? v.toPrecision(2) : v.toFixed(a < 10 ? 2 : 1);
}

// Axis labels around a heatmap: a grid of [y labels | canvas] with x labels on top.
export function labelledHeatmap(canvas, xLabels, yLabels, cell) {
  const wrap = el("div", { class: "heat-wrap" });
  const xl = el("div", { class: "xlabels" });
  const yl = el("div", { class: "ylabels" });
  const size = Math.max(cell, 1);
  const fontFits = size >= 10;
  for (const label of xLabels) xl.append(el("span", { style: `width:${size}px;height:64px;${fontFits ? "" : "font-size:0"}` }, label));
  for (const label of yLabels) yl.append(el("span", { style: `height:${size}px;line-height:${size}px;${fontFits ? "" : "font-size:0"}` }, label));
  wrap.append(el("div"), xl, yl, canvas);
  return wrap;
}

export { showTip, hideTip };
