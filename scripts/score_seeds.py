"""Score several translation runs (seeds of one recipe) one by one and as an ensemble, on the
splits asked for: the seed table (docs/translation.md).

    python scripts/score_seeds.py --run runs/de-en-seed0 --run runs/de-en-seed2 --model multi30k-de-en \
        --splits val test2016 --threads 1 --json scores.json

Each --run is scored at RUN/averaged-last5 when it has one (its latest checkpoint otherwise), each
--model (a shipped model or a release directory) as it is. Beam size and length penalty default to
the first member's recipe, as `aiayn evaluate` does. Prints one markdown table: every member's
cased sacreBLEU, chrF and lower-cased BLEU per split, the members' mean and spread (max - min), and
the ensemble of all of them (one search over the mean of their log-probabilities), or the
ensembles --ensemble names (member numbers, e.g. --ensemble 1,2,3 --ensemble 1,4); --json writes
the same figures. Splits are read from the members' corpus (AIAYN_DATA_DIR, default ../shared/data).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aiayn.data.parallel import read_parallel, split_paths
from aiayn.tasks.runs import load_ensemble_translator, load_translator
from aiayn.tasks.trained import resolve_model
from aiayn.tasks.translation import corpus_score
from aiayn.translate import decode_options


def member(path: Path) -> tuple[Path, Path | None]:
    """A run at its averaged checkpoint (if it has one), or a release as it is."""
    averaged = path / "averaged-last5"
    return path, averaged if averaged.is_dir() else None


def ensemble_members(numbers: str, count: int, parser: argparse.ArgumentParser) -> list[int]:
    """The 1-based member numbers of one --ensemble ("1,3"): at least two, each once, each a member."""
    try:
        chosen = [int(n) for n in numbers.split(",")]
    except ValueError:
        parser.error(f"--ensemble {numbers!r}: give member numbers separated by commas, e.g. 1,3")
    if len(chosen) < 2 or len(set(chosen)) != len(chosen) or not all(1 <= n <= count for n in chosen):
        parser.error(f"--ensemble {numbers!r}: two or more different numbers from 1 to {count} (the members in "
                     f"the order given)")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, action="append", default=[], help="a finished run; repeat it")
    parser.add_argument("--model", action="append", default=[], help="a shipped model or release; repeat it")
    parser.add_argument("--splits", nargs="+", default=["val"], help="splits to score (val, test2016)")
    parser.add_argument("--beam", type=int, help="beam size (default: the first member's recipe)")
    parser.add_argument("--length-penalty", type=float, help="alpha (default: the first member's recipe)")
    parser.add_argument("--ensemble", action="append", default=[], metavar="I,J,...",
                        help="an ensemble to score, as the members' numbers in the order given (1-based, "
                             "e.g. 1,3); repeat it for several (default: all the members together)")
    parser.add_argument("--no-ensemble", action="store_true", help="score the members only")
    parser.add_argument("--threads", type=int, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    members = [member(run) for run in args.run] + [(resolve_model(name), None) for name in args.model]
    if not members:
        parser.error("give at least one --run or --model")
    names = [f"{i}. {path}" + (f" ({checkpoint.name})" if checkpoint is not None else "")
             for i, (path, checkpoint) in enumerate(members, start=1)]
    candidates = [(name, [m]) for name, m in zip(names, members, strict=True)]
    if not args.no_ensemble:
        for numbers in args.ensemble or ([",".join(str(i) for i in range(1, len(members) + 1))]
                                         if len(members) > 1 else []):
            chosen = ensemble_members(numbers, len(members), parser)
            candidates.append((f"ensemble of {len(chosen)} ({'+'.join(str(i) for i in chosen)})",
                               [members[i - 1] for i in chosen]))

    scores: dict[str, dict[str, dict[str, float]]] = {}
    options = None
    for name, chosen in candidates:
        task, translator = (load_translator(*chosen[0]) if len(chosen) == 1
                            else load_ensemble_translator(chosen))
        if options is None:  # the first member's recipe, for every candidate
            options = decode_options(task.decode, beam_size=args.beam, length_penalty=args.length_penalty)
        scores[name] = {}
        for split in args.splits:
            sources, references = read_parallel(*split_paths(task.root(), split, task.src_lang, task.tgt_lang))
            start = time.perf_counter()
            result = corpus_score(translator.translate(sources, options), references)
            scores[name][split] = {key: round(result[key], 2) for key in ("bleu", "chrf", "bleu_lc")}
            print(f"# {name} {split}: BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f} "
                  f"lc {result['bleu_lc']:.2f} ({time.perf_counter() - start:.0f} s)", flush=True)

    assert options is not None
    print(f"\nbeam {options.beam_size}, length penalty {options.length_penalty}, cased sacreBLEU / chrF / "
          f"lower-cased BLEU\n")
    print("| model | " + " | ".join(args.splits) + " |")
    print("|---|" + "---|" * len(args.splits))
    for name, per_split in scores.items():
        print(f"| {name} | " + " | ".join(
            f"{s['bleu']:.2f} / {s['chrf']:.2f} / {s['bleu_lc']:.2f}" for s in per_split.values()) + " |")
        if name == names[-1] and len(names) > 1:  # after the members: their mean and spread
            cells = []
            for split in args.splits:
                values = [scores[n][split]["bleu"] for n in names]
                cells.append(f"{sum(values) / len(values):.2f} ± {max(values) - min(values):.2f} (spread)")
            print("| members' BLEU: mean ± spread | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"beam": options.beam_size, "length_penalty": options.length_penalty,
                                         "scores": scores}, indent=1) + "\n")


if __name__ == "__main__":
    main()
