// View 5: the training run (GET /api/run): loss, validation metrics (BLEU for translation), the
// learning rate from metrics.csv, and the run's config and summary.
import { getJSON, el } from "./api.js";
import { lineChart, legend } from "./draw.js";

const NAMES = { train_loss: "train loss", train_nll: "train NLL", val_nll: "val NLL", val_ppl: "val perplexity",
  train_acc: "train accuracy", val_acc: "val accuracy", val_seq_acc: "val sequence accuracy", val_bleu: "val BLEU",
  lr: "learning rate", tokens_per_s: "tokens/s" };

function chart(title, run, fields, { yLabel = "", id, logY = false } = {}) {
  const series = fields.filter((f) => run.series[f]).map((f) => ({
    name: NAMES[f] || f, points: run.series[f], dots: f.startsWith("val_") }));
  if (!series.length) return null;
  const svg = lineChart(series, { xLabel: "step", yLabel, width: 460, height: 250, logY });
  svg.id = id;
  return el("div", { class: "col", style: "flex: 0 0 auto" }, el("h3", {}, title), svg, legend(series));
}

function table(object, id) {
  const rows = [];
  for (const [key, value] of Object.entries(object || {})) {
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      for (const [k, v] of Object.entries(value)) rows.push([`${key}.${k}`, v]);
    } else {
      rows.push([key, value]);
    }
  }
  return el("table", { class: "kv", id }, rows.map(([k, v]) => el("tr", {}, el("td", {}, k),
    el("td", {}, typeof v === "number" ? String(Number(v.toPrecision(6))) : JSON.stringify(v)))));
}

export async function trainingView(section, model) {
  const run = await getJSON("/api/run");  // read again by "Reload" (a run still training grows)
  if (!run.available) {
    section.replaceChildren(el("h2", {}, "Training run"), el("p", { class: "lead" }, run.reason));
    return;
  }
  const config = run.config || {};
  const charts = [
    chart("Loss (nats per token)", run, ["train_loss", "train_nll", "val_nll"], { yLabel: "loss", id: "train-loss" }),
    chart("Validation", run, ["val_bleu"], { yLabel: "BLEU", id: "train-bleu" }),
    chart("Accuracy", run, ["train_acc", "val_acc", "val_seq_acc"], { yLabel: "accuracy", id: "train-acc" }),
    chart("Learning rate", run, ["lr"], { yLabel: "lr", id: "train-lr" }),
  ].filter(Boolean);
  section.replaceChildren(...[
    el("h2", {}, "Training run"),
    el("p", { class: "lead" }, `${run.run}: ${run.rows} rows of metrics.csv (task ${config.task || "?"}). ` +
      "Lines are training steps, dots evaluations. ",
      el("button", { class: "ghost", id: "train-reload", onclick: () => trainingView(section, model) }, "Reload")),
    run.note ? el("p", { class: "message" }, run.note) : null,
    el("div", { class: "row", id: "train-charts" }, charts),
    el("div", { class: "row" },
      el("div", { class: "col" }, el("h3", {}, "Summary (summary.json)"), table(run.summary, "train-summary")),
      el("div", { class: "col" }, el("h3", {}, "Model config"), table(config.model, "train-model-config")),
      el("div", { class: "col" }, el("h3", {}, "Training config"),
        table({ ...config.train, task: config.task, task_options: config.task_options }, "train-config")))].filter(Boolean));
}
