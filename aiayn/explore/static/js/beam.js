// View 3: the beam-search tree (POST /api/beam: aiayn.generate.beam_search_encoder_decoder with its
// trace). Every candidate of every step: kept in a beam, finished with </s>, or pruned; the n-best.
import { postJSON, el, svgEl, tokenPreview, debounce, showTip, hideTip } from "./api.js";

const COL = 96; // px between steps
const ROW = 40; // px between candidates of one step
const BOX_W = 86;
const BOX_H = 32;

export async function beamView(section, model) {
  const translation = model.kind === "translation";
  const end = model.eos || "end-of-text";  // a character-level model has none: every hypothesis runs to the limit
  const text = el("textarea", { id: "beam-text", rows: 2, spellcheck: "false" },
    translation ? model.default_text : model.default_text.split("\n")[0]);
  const steps = translation ? null : el("input", { type: "number", id: "beam-steps", min: 1, max: 64, value: 12 });
  const chips = el("div", { class: "chips" });
  const count = el("span", { class: "count" });
  const message = el("div", { class: "message", id: "beam-message" });
  const beam = el("input", { type: "range", id: "beam-size", min: 1, max: 8, step: 1, value: 4 });
  const beamValue = el("b", { id: "beam-size-value" }, "4");
  const alpha = el("input", { type: "range", id: "beam-alpha", min: 0, max: 2, step: 0.1, value: 0.6 });
  const alphaValue = el("b", { id: "beam-alpha-value" }, "0.6");
  const runButton = el("button", { id: "beam-run" }, "Search");
  const summary = el("div", { class: "note", id: "beam-summary" });
  const tree = el("div", { class: "tree-wrap", id: "beam-tree" });
  const nbest = el("table", { class: "nbest", id: "beam-nbest" });

  section.replaceChildren(
    el("h2", {}, "Beam search tree"),
    el("p", { class: "lead" }, "Each step ranks the 2 × beam best continuations of the open beams by their summed " +
      (model.eos ? `log-probability: the first beam of them that are not ${end} become the next beams, an ${end} ` +
        "ranked within the first beam finishes its hypothesis, the rest are pruned. "
        : "log-probability: the first beam of them become the next beams, the rest are pruned (this model has no " +
        "end-of-text token: every hypothesis runs to the limit). ") +
      "Finished hypotheses are ranked by score / ((5 + length) / 6)^α (GNMT's length penalty); a larger α favours " +
      (translation ? "longer translations." : "longer continuations. The tree starts from the prompt's last token.")),
    el("div", { class: "panel" },
      el("label", { for: "beam-text" }, translation ? "Source sentence" : "Prompt"), text,
      el("div", { class: "controls" }, count,
        el("label", {}, "beam ", beam, " ", beamValue),
        el("label", {}, "length penalty α ", alpha, " ", alphaValue),
        steps ? el("label", {}, "new tokens ", steps) : null, runButton),
      chips, message),
    summary,
    el("div", { class: "legend" },
      el("span", {}, el("i", { style: "background:#dbe6fd;border-color:#2563eb" }), "kept (open beam)"),
      model.eos ? el("span", {}, el("i", { style: "background:#dcfce7;border-color:#15803d" }), `finished with ${end}`) : null,
      el("span", {}, el("i", { style: "background:#ccfbf1;border-color:#0f766e" }), "finished at the length limit"),
      el("span", {}, el("i", { style: "background:#f3f4f6;border-style:dashed" }), "pruned"),
      el("span", {}, el("i", { style: "background:white;border-color:#ea580c;border-width:2px" }), "the best hypothesis")),
    tree,
    el("h3", {}, "n-best (the search's finished hypotheses, best first)"), nbest);
  if (steps) steps.addEventListener("change", () => run());

  tokenPreview({ input: text, chips, count, message, onState: (ok) => { runButton.disabled = !ok; } });

  let data = null;
  const nodeEls = new Map();
  const edgeEls = new Map();

  function path(id) {
    const ids = [];
    for (let n = id; n !== null && n !== undefined; n = data.nodes[n].parent) ids.push(n);
    return ids;
  }

  function highlight(id) {
    for (const g of nodeEls.values()) g.classList.remove("best");
    for (const e of edgeEls.values()) e.classList.remove("best");
    if (id === null || id === undefined) return;
    for (const n of path(id)) {
      nodeEls.get(n).classList.add("best");
      if (edgeEls.has(n)) edgeEls.get(n).classList.add("best");
    }
  }

  function draw() {
    nodeEls.clear();
    edgeEls.clear();
    const rowOf = new Map();
    const perStep = new Map();
    for (const node of data.nodes) {
      const r = perStep.get(node.t) || 0;
      perStep.set(node.t, r + 1);
      rowOf.set(node.id, r);
    }
    const rows = Math.max(...perStep.values());
    const width = (data.steps + 1) * COL + 20;
    const height = rows * ROW + 20;
    const svg = svgEl("svg", { class: "tree", width, height, id: "beam-svg" });
    const xy = (node) => [10 + node.t * COL, 10 + rowOf.get(node.id) * ROW];
    const edges = svgEl("g");
    svg.append(edges);
    for (const node of data.nodes) {
      const [x, y] = xy(node);
      if (node.parent !== null) {
        const [px, py] = xy(data.nodes[node.parent]);
        const e = svgEl("path", { class: "edge", d: `M${px + BOX_W},${py + BOX_H / 2} C${px + BOX_W + 6},${py + BOX_H / 2} ` +
          `${x - 6},${y + BOX_H / 2} ${x},${y + BOX_H / 2}` });
        edges.append(e);
        edgeEls.set(node.id, e);
      }
      const score = node.t === 0 ? "" : node.score.toFixed(2) + (node.normalized !== undefined ? ` → ${node.normalized.toFixed(2)}` : "");
      const g = svgEl("g", { class: `node ${node.status}`, "data-id": node.id, "data-status": node.status,
        transform: `translate(${x},${y})` },
        svgEl("rect", { width: BOX_W, height: BOX_H }),
        svgEl("text", { x: 5, y: 13 }, node.label.length > 10 ? `${node.label.slice(0, 9)}…` : node.label),
        svgEl("text", { x: 5, y: 27, style: "font-size:10px", fill: "#4b5563" }, score));
      g.addEventListener("mousemove", (event) => showTip(event, `step ${node.t}: ${node.label}\n` +
        `sum log-prob ${node.score.toFixed(4)}` + (node.normalized !== undefined
        ? `\nnormalized ${node.normalized.toFixed(4)} (÷ ((5 + ${node.t}) / 6)^${data.length_penalty})` : "") +
        `\n${node.status}${node.slot >= 0 ? ` (beam slot ${node.slot})` : ""}`));
      g.addEventListener("mouseleave", hideTip);
      svg.append(g);
      nodeEls.set(node.id, g);
    }
    tree.replaceChildren(svg);
    const counts = {};
    for (const node of data.nodes) counts[node.status] = (counts[node.status] || 0) + 1;
    summary.textContent = `${data.steps} steps, ${data.nodes.length - 1} candidates: ${counts.kept - 1 || 0} kept, ` +
      (model.eos ? `${counts.finished || 0} finished with ${end}, ` : "") +
      `${counts.limit || 0} at the length limit, ${counts.pruned || 0} pruned.`;
    nbest.replaceChildren(el("tr", {}, el("th", {}, "#"), el("th", {}, translation ? "translation" : "continuation"),
      el("th", {}, "tokens"),
      el("th", {}, "sum log-prob"), el("th", {}, "normalized")),
      ...data.nbest.map((h, rank) => {
        const tr = el("tr", { "data-node": h.node }, el("td", {}, String(rank + 1)), el("td", { class: "hyp" }, h.text),
          el("td", {}, String(h.length)), el("td", {}, h.score.toFixed(3)), el("td", {}, h.normalized.toFixed(3)));
        tr.addEventListener("mouseenter", () => highlight(h.node));
        tr.addEventListener("mouseleave", () => highlight(data.nbest.length ? data.nbest[0].node : null));
        return tr;
      }));
    highlight(data.nbest.length ? data.nbest[0].node : null);
  }

  let seq = 0;
  async function run() {
    const mine = ++seq;
    message.textContent = "";
    runButton.classList.add("spinner");
    try {
      const request = { text: text.value, beam: Number(beam.value), length_penalty: Number(alpha.value) };
      if (steps) request.steps = Number(steps.value);
      const result = await postJSON("/api/beam", request);
      if (mine !== seq) return;
      data = result;
      draw();
      section.dataset.searched = String(mine);
    } catch (err) {
      if (mine === seq) message.textContent = err.message;
    } finally {
      if (mine === seq) runButton.classList.remove("spinner");
    }
  }
  const rerun = debounce(run, 250);
  beam.addEventListener("input", () => { beamValue.textContent = beam.value; rerun(); });
  alpha.addEventListener("input", () => { alphaValue.textContent = Number(alpha.value).toFixed(1); rerun(); });
  runButton.addEventListener("click", run);
  await run();
}
