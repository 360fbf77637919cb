"""Write a finished run, or several as an ensemble, as a model shipped inside the package
(aiayn/pretrained/NAME/).

    python scripts/ship_model.py --run runs/multi30k-en-de --checkpoint runs/multi30k-en-de/averaged-last5 \
        --name multi30k-en-de --recipe recipes/multi30k-en-de.yaml --scores scores.json

    python scripts/ship_model.py --name multi30k-en-de --recipe recipes/multi30k-en-de.yaml \
        --run runs/en-de-seed0 --run runs/en-de-seed1 --run runs/en-de-seed2 \
        --checkpoint runs/en-de-seed0/averaged-last5 --checkpoint ... --member seed0 --member seed1 ...

    python scripts/ship_model.py --name multi30k-en-de --recipe recipes/multi30k-en-de.yaml \
        --run multi30k-en-de --run results/issue36/en-de-seed1 --run results/issue36/en-de-seed2 \
        --member seed0 --member seed1 --member seed2

The weights are stored in float16 (or --dtype bfloat16), tied weights once; the run's config,
tokenizer, metrics, summary and scores go with them (aiayn.tasks.shipped.write_release). Several
--run make an ensemble release (write_ensemble_release): each run a member release of its own
(named by --member, default its run folder's name), in the order given. A --run may also be a
release (a shipped model's name or folder, or one kept in results/issue36/): it is copied byte for
byte, not rounded again, so an ensemble can be made of members whose runs are gone; `aiayn translate --model
NAME` then translates with all of them. --scores is a JSON object of the figures `aiayn models`
prints (measured with `aiayn evaluate`), and --usage the command line that shows the model at work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiayn.tasks.shipped import write_ensemble_release, write_release
from aiayn.tasks.trained import SHIPPED_DIR, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True,
                        help="a finished run directory, or a release (a shipped name or a release folder); "
                             "repeat it for an ensemble")
    parser.add_argument("--checkpoint", type=Path, action="append", default=[],
                        help="a checkpoint (e.g. RUN/averaged-last5), one per --run in order; default: latest")
    parser.add_argument("--member", action="append", default=[],
                        help="an ensemble member's folder name, one per --run; default: the run folder's name")
    parser.add_argument("--name", required=True, help="the shipped name (aiayn/pretrained/NAME)")
    parser.add_argument("--recipe", type=Path, help="the recipe the run was trained with")
    parser.add_argument("--scores", type=Path, help="a JSON object of measured scores to record")
    parser.add_argument("--member-scores", type=Path,
                        help="an ensemble's members' own scores: a JSON list of objects, one per --run in order")
    parser.add_argument("--usage", help="a command line that uses the model")
    parser.add_argument("--trained-with", help="the command line that trained the run")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--out", type=Path,
                        help="write the release here instead of aiayn/pretrained/NAME (e.g. a run kept in "
                             "results/ as a later ensemble's member; recipes/sweeps/README.md)")
    args = parser.parse_args()
    runs = [resolve_model(run) for run in args.run]  # a shipped name becomes its release folder
    if args.checkpoint and len(args.checkpoint) != len(runs):
        parser.error(f"{len(args.checkpoint)} --checkpoint for {len(runs)} --run; give one per --run, in order")
    if args.member and len(args.member) != len(runs):
        parser.error(f"{len(args.member)} --member for {len(runs)} --run; give one per --run, in order")
    extra = {"scores": json.loads(args.scores.read_text()) if args.scores else {}}
    if args.usage:
        extra["usage"] = args.usage
    if args.trained_with:
        extra["trained_with"] = args.trained_with
    checkpoints = args.checkpoint or [None] * len(runs)
    out_dir = args.out or SHIPPED_DIR / args.name
    if len(runs) == 1:
        out = write_release(runs[0], out_dir, checkpoint=checkpoints[0], dtype=args.dtype,
                            name=args.name, recipe=args.recipe, extra=extra)
    else:
        members = list(zip(runs, checkpoints, args.member or [run.name for run in runs], strict=True))
        member_scores = json.loads(args.member_scores.read_text()) if args.member_scores else None
        out = write_ensemble_release(members, out_dir, dtype=args.dtype, name=args.name,
                                     recipe=args.recipe, extra=extra, member_scores=member_scores)
    print(f"wrote {out}: {json.loads((out / 'release.json').read_text())['weight_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
