// The page: load the model's summary, then show one view at a time (#attention, #generate, ...).
// Each view is built the first time it is shown and kept, so switching back is instant.
import { getJSON, el } from "./api.js";
import { attentionView } from "./attention.js";
import { generateView } from "./generate.js";
import { beamView } from "./beam.js";
import { positionsView } from "./positions.js";
import { trainingView } from "./training.js";

const VIEWS = { attention: attentionView, generate: generateView, beam: beamView, positions: positionsView,
  training: trainingView };
const built = new Set();
let model = null;

function unavailable(section, name, reason) {
  section.replaceChildren(el("h2", {}, section.dataset.title || name), el("p", { class: "lead unavailable-reason" },
    `Not for this model: ${reason}.`));
}

async function show(name) {
  if (!(name in VIEWS)) name = "attention";
  for (const link of document.querySelectorAll("#tabs a")) link.classList.toggle("active", link.dataset.view === name);
  for (const key of Object.keys(VIEWS)) document.getElementById(`view-${key}`).hidden = key !== name;
  const section = document.getElementById(`view-${name}`);
  if (built.has(name) || model === null) return;
  built.add(name);
  const reason = model.views[name];
  if (reason) { unavailable(section, name, reason); return; }
  try {
    await VIEWS[name](section, model);
  } catch (err) {
    section.append(el("p", { class: "message" }, err.message));
  }
}

async function boot() {
  try {
    model = await getJSON("/api/model");
  } catch (err) {
    document.getElementById("model-name").textContent = `cannot reach the explorer: ${err.message}`;
    return;
  }
  const params = model.arch === "encoder-decoder"
    ? `${model.layers}+${model.decoder_layers} layers` : `${model.layers} layers`;
  const kv = model.kv_heads !== model.heads ? ` (${model.kv_heads} kv heads)` : "";
  document.getElementById("model-name").textContent =
    `${model.name} · ${model.arch}, ${params} × ${model.heads} heads${kv}, d_model ${model.d_model}, ` +
    `${(model.parameters / 1e6).toFixed(2)}M parameters · ` +
    (model.origin.length > 64 ? `${model.origin.split(" ")[0]} …${model.origin.slice(-48)}` : model.origin);
  document.getElementById("model-name").title = model.origin;
  for (const link of document.querySelectorAll("#tabs a")) {
    const reason = model.views[link.dataset.view];
    link.classList.toggle("unavailable", Boolean(reason));
    if (reason) link.title = reason;
  }
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  await show(location.hash.slice(1));
  document.body.dataset.ready = "1";
}

boot();
