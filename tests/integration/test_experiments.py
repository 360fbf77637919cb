"""``aiayn experiment``: each experiment runs end to end at its tiny budget and writes its table,
CSV, JSON and plot; a second run resumes (finished variants skipped, an interrupted one continued
from its checkpoint); bad requests get one-line errors.

The data are synthetic and small (AIAYN_DATA_DIR points at them): a 24-word "English" to "German"
word-for-word corpus for Table 3 and 40,000 characters of made-up text for the character model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import matplotlib.image
import pytest

from aiayn.experiments import ExperimentError, get_experiment, run_experiment
from aiayn.experiments.base import RESULT, variant_state
from aiayn.experiments.length_extrapolation import loss_by_position

WORDS = {"the": "die", "cat": "katze", "dog": "hund", "sees": "sieht", "a": "eine", "man": "mann",
         "woman": "frau", "eats": "isst", "red": "rote", "big": "grosse", "ball": "ball", "runs": "rennt",
         "in": "in", "park": "park", "with": "mit", "child": "kind", "small": "kleine", "house": "haus",
         "blue": "blaue", "car": "auto", "and": "und", "sits": "sitzt", "on": "auf", "street": "strasse"}


def write_data(root: Path) -> Path:
    """Synthetic Multi30k (train 300, val 30, test2016 30 pairs) and Tiny Shakespeare (40k characters)."""
    rng = random.Random(0)
    multi30k = root / "multi30k"
    multi30k.mkdir(parents=True)
    for split, n in (("train", 300), ("val", 30), ("test2016", 30)):
        pairs = [[rng.choice(list(WORDS)) for _ in range(rng.randint(3, 9))] for _ in range(n)]
        (multi30k / f"{split}.en").write_text("\n".join(" ".join(p) for p in pairs) + "\n", encoding="utf-8")
        (multi30k / f"{split}.de").write_text("\n".join(" ".join(WORDS[w] for w in p) for p in pairs) + "\n",
                                              encoding="utf-8")
    text = "\n".join(" ".join(rng.choice(list(WORDS)) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(6000))[:40000]
    (root / "tinyshakespeare").mkdir()
    (root / "tinyshakespeare" / "input.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture()
def data(tmp_path, monkeypatch) -> Path:
    root = write_data(tmp_path / "data")
    monkeypatch.setenv("AIAYN_DATA_DIR", str(root))
    return root


def png_size(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


@pytest.mark.slow
def test_length_extrapolation_end_to_end_then_resume(data, tmp_path, run_aiayn_process):
    """The CLI runs the four decoders (two at a time, in worker processes), writes the table (learned positions stop at their table),
    CSV, JSON and plot; --resume then skips the finished variants and continues an interrupted one
    from its checkpoint to the same numbers (the trainer's exact resume)."""
    out = tmp_path / "le"
    env = {"AIAYN_DATA_DIR": str(data), "OMP_NUM_THREADS": "1"}
    done = run_aiayn_process("experiment", "length-extrapolation", "--budget", "tiny", "--out", str(out), "--threads",
                             "1", "--jobs", "2", "--no-progress", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == ["sinusoidal", "learned", "rope", "alibi"]
    assert results["command"].startswith("aiayn experiment length-extrapolation --budget tiny")
    for name, row in rows.items():
        assert row["train_len"] == 16 and row["ppl@16"] > 1
        if name == "learned":  # no table rows past position 15: shown as the limit, not a crash
            assert row["max_seq_len"] == 16 and row["ppl@32"] is None and row["ppl@64"] is None
        else:
            assert row["max_seq_len"] == 64 and 1 < row["ppl@64"] < 1000
            assert len(row["loss_by_position"]) == 64
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| learned | 18,816 |" in table and "| – | – |" in table
    assert (out / "results.csv").read_text(encoding="utf-8").splitlines()[0].startswith("variant,positional,params")
    assert png_size(out / "perplexity_vs_length.png") == (1200, 450)
    assert "| rope |" in done.stdout  # the table is printed at the end
    assert "training 4 variant(s), 2 at a time" in done.stdout

    # Interrupt "rope" after its step-4 checkpoint: its later checkpoints, summary and result go.
    rope = out / "rope"
    for late in sorted((rope / "checkpoints").glob("step-*"))[1:]:
        for f in late.iterdir():
            f.unlink()
        late.rmdir()
    (rope / "summary.json").unlink()
    (rope / RESULT).unlink()
    kept = {name: (out / name / RESULT).stat().st_mtime_ns for name in ("sinusoidal", "learned", "alibi")}
    again = run_aiayn_process("experiment", "length-extrapolation", "--budget", "tiny", "--out", str(out), "--resume",
                              "--threads", "1", "--no-progress", env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done earlier, skipped") == 3
    assert "rope (rope positions, trained on 16 characters): resuming from its checkpoint" in again.stdout
    assert "from step-00000004" in again.stdout
    assert {name: (out / name / RESULT).stat().st_mtime_ns for name in kept} == kept
    resumed = json.loads((rope / RESULT).read_text(encoding="utf-8"))
    for key in ("ppl@16", "ppl@32", "ppl@64"):
        assert resumed[key] == rows["rope"][key]
    assert resumed["wall_s"] > rows["rope"]["wall_s"]  # the cost adds up over the variant's sessions


@pytest.mark.slow
def test_table3_end_to_end(data, tmp_path):
    """Nineteen tiny variants train, each through the trainer into its own run; the table holds our
    val PPL and greedy BLEU beside the paper's column, one trend line per row group, and the plot."""
    experiment = get_experiment("table3")
    lines: list[str] = []
    result = run_experiment(experiment, tmp_path / "t3", budget="tiny", threads=1, progress=False,
                            echo=lines.append, command="test")
    rows = {r["variant"]: r for r in result.rows}
    assert len(rows) == 19 and list(rows)[:2] == ["base", "base-seed1"]
    base = rows["base"]
    assert (base["n_layers"], base["d_model"], base["d_ff"], base["n_heads"], base["head_dim"]) == (2, 32, 64, 8, 4)
    assert (base["dropout"], base["label_smoothing"], base["positional"]) == (0.1, 0.1, "sinusoidal")
    # Each row changes what the paper's row changes, and nothing else.
    assert [rows[f"A-h{h}"]["head_dim"] for h in (1, 4, 16, 32)] == [32, 8, 2, 1]
    assert {rows[f"A-h{h}"]["params"] for h in (1, 4, 16, 32)} == {base["params"]}  # same width, same cost
    assert (rows["B-dk-quarter"]["head_dim"], rows["B-dk-half"]["head_dim"]) == (1, 2)
    assert [rows[f"C-N{n}"]["n_layers"] for n in (1, 3)] == [1, 3]
    assert (rows["C-N1"]["paper_row"], rows["C-N3"]["paper_row"]) == ("N=2", "N=8")
    assert rows["C-d_model-double"]["d_model"] == 64 and rows["C-d_ff-half"]["d_ff"] == 32
    assert rows["D-dropout-0.2"]["dropout"] == 0.2 and rows["D-ls-0"]["label_smoothing"] == 0.0
    assert rows["E-learned"]["positional"] == "learned"
    assert (rows["A-h1"]["paper_ppl"], rows["A-h1"]["paper_bleu"]) == (5.29, 24.9)
    assert rows["base-seed1"]["val_ppl"] != base["val_ppl"]  # another seed, another run
    for row in rows.values():
        assert 1 < row["val_ppl"] < 1000 and 0 <= row["val_bleu"] <= 100
        run = tmp_path / "t3" / row["variant"]
        assert (run / "hypotheses.val.de").is_file() and not list(run.glob("*test2016*"))  # val only
    table = (tmp_path / "t3" / "results.md").read_text(encoding="utf-8")
    assert "| A | h=1, d_k=d_v=32 |" in table and "| h=1, d_k=d_v=512 | 5.29 | 24.90 | – |" in table
    assert table.count("Here PPL moves the paper's way in") == 5
    assert png_size(tmp_path / "t3" / "table3.png")[0] == 1400


def test_listing_and_errors(data, tmp_path, capsys):
    """`aiayn experiment` lists the experiments with their budgets; an unknown name or budget and a
    foreign --out folder are one-line usage errors (exit 2) that touch nothing."""
    from aiayn.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["experiment"])
    listed = capsys.readouterr()
    assert exited.value.code in (0, None), listed.err
    assert "table3:" in listed.out and "length-extrapolation:" in listed.out
    assert listed.out.count("--budget full:") == 2 and listed.out.count("--budget tiny:") == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n", encoding="utf-8")
    for args, message in ((["tabel3"], "did you mean table3?"),
                          (["table3", "--budget", "huge", "--out", str(tmp_path / "x")], "no budget 'huge'"),
                          (["table3", "--budget", "tiny", "--out", str(foreign)], "aiayn did not create it")):
        with pytest.raises(SystemExit) as exited:
            main(["experiment", *args])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_an_existing_experiment_needs_resume_and_the_same_budget(data, tmp_path):
    experiment = get_experiment("length-extrapolation")
    out = tmp_path / "le"
    budget = experiment.budget("tiny")
    from aiayn.experiments.base import prepare_out_dir

    prepare_out_dir(experiment, out, budget, resume=False, variants=experiment.variants(budget), command="x")
    with pytest.raises(ExperimentError, match="pass --resume"):
        run_experiment(experiment, out, budget="tiny")
    with pytest.raises(ExperimentError, match="started with --budget tiny"):
        run_experiment(experiment, out, budget="full", resume=True)
    with pytest.raises(ExperimentError, match="holds the results of experiment 'length-extrapolation'"):
        run_experiment(get_experiment("table3"), out, budget="tiny", resume=True)


def test_a_variant_trained_with_another_config_is_refused(data, tmp_path):
    from aiayn.train.run_dir import RunDirError

    experiment = get_experiment("length-extrapolation")
    variant = experiment.variants(experiment.budget("tiny"))[0]
    run = tmp_path / variant.name
    run.mkdir()
    assert variant_state(variant, run) == "new"
    task, model, train = variant.build()
    from aiayn.experiments.base import run_configs

    configs = run_configs(task, model, train)
    configs["model"]["d_model"] = 48
    (run / "config.json").write_text(json.dumps(configs), encoding="utf-8")
    with pytest.raises(RunDirError, match="another config"):
        variant_state(variant, run)


def test_loss_by_position_is_the_mean_cross_entropy_of_each_position():
    import torch

    from aiayn.models import build_model
    from aiayn.models.presets import get_preset

    torch.manual_seed(0)
    model = build_model(get_preset("gpt-tiny")).eval()
    vocab = get_preset("gpt-tiny").vocab_size
    tokens = torch.randint(vocab, (200,))
    curve = loss_by_position(model, tokens, 16, n_chars=100, batch_tokens=40)  # 6 windows, batches of 2
    windows = torch.stack([tokens[i * 16: i * 16 + 17] for i in range(6)])
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)
    torch.testing.assert_close(curve.float(), expected)


COMMITTED = Path(__file__).resolve().parents[2] / "results" / "experiments"


@pytest.mark.parametrize("name", ["length-extrapolation", "table3"])
def test_committed_tables_are_what_the_report_writes_from_the_committed_rows(name, tmp_path):
    """results/experiments/NAME/results.md and results.csv are the experiment's own report of the
    rows in results.json (nothing edited by hand), and each row is its variant's result.json."""
    folder = COMMITTED / name
    committed = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    for row in committed["rows"]:
        assert json.loads((folder / row["variant"] / RESULT).read_text(encoding="utf-8")) == row
    (tmp_path / "experiment.json").write_text((folder / "experiment.json").read_text(encoding="utf-8"),
                                              encoding="utf-8")
    experiment = get_experiment(name)
    experiment.report(committed["rows"], tmp_path, experiment.budget(committed["budget"]))
    for table in ("results.md", "results.csv"):
        assert (tmp_path / table).read_text(encoding="utf-8") == (folder / table).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["length-extrapolation", "table3"])
def test_committed_variants_match_the_current_code(name):
    """Each committed variant's config is what the experiment builds today, so `--resume` on those
    runs skips them instead of refusing (a default elsewhere, such as the translation task's
    epochs, must not leak into a variant's config)."""
    experiment = get_experiment(name)
    committed = json.loads((COMMITTED / name / "results.json").read_text(encoding="utf-8"))
    for variant in experiment.variants(experiment.budget(committed["budget"])):
        assert variant_state(variant, COMMITTED / name / variant.name) == "measured", variant.name
