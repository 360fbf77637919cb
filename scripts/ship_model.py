"""Write a finished run as a model shipped inside the package (aiayn/pretrained/NAME/).

    python scripts/ship_model.py --run runs/multi30k-en-de --checkpoint runs/multi30k-en-de/averaged-last5 \
        --name multi30k-en-de --recipe recipes/multi30k-en-de.yaml --scores scores.json

The weights are stored in float16 (or --dtype bfloat16), tied weights once; the run's config,
tokenizer, metrics, summary and scores go with them (aiayn.tasks.shipped.write_release). --scores
is a JSON object of the figures `aiayn models` prints (measured with `aiayn evaluate`), and --usage
the command line that shows the model at work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiayn.tasks.shipped import SHIPPED_DIR, write_release


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the finished run directory")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint (e.g. RUN/averaged-last5); default: latest")
    parser.add_argument("--name", required=True, help="the shipped name (aiayn/pretrained/NAME)")
    parser.add_argument("--recipe", type=Path, help="the recipe the run was trained with")
    parser.add_argument("--scores", type=Path, help="a JSON object of measured scores to record")
    parser.add_argument("--usage", help="a command line that uses the model")
    parser.add_argument("--trained-with", help="the command line that trained the run")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args()
    extra = {"scores": json.loads(args.scores.read_text()) if args.scores else {}}
    if args.usage:
        extra["usage"] = args.usage
    if args.trained_with:
        extra["trained_with"] = args.trained_with
    out = write_release(args.run, SHIPPED_DIR / args.name, checkpoint=args.checkpoint, dtype=args.dtype,
                        name=args.name, recipe=args.recipe, extra=extra)
    print(f"wrote {out}: {json.loads((out / 'release.json').read_text())['weight_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
