"""Two aiayn jobs on one machine: does each keep near its fair share of the cores?

Job A is ``aiayn train`` (the default reverse run, or ``--steps``); job B a steady ``aiayn
translate`` with beam search. Per OpenMP policy (``old``: sharing off, libgomp's spin count;
``aiayn``: the command as it is; ``passive``; any ``--policy``), interleaved rounds of A alone,
B alone and A beside a warmed-up B. Fair share is about 2x A's time alone; the goal is at most 2.5x
with nothing lost alone. Figures are medians of the rounds with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiayn import cpu_share
from benchmarks.common import ROOT, footer, header, mark_start, median_ratio, spread_text, table

# OpenMP spin settings, thread counts and aiayn's sharing switch: removed from every policy's environment.
USER_SPIN_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                      "AIAYN_SHARE_CPUS")

# Varied lengths (5 to 17 words), cycled: B translates them one by one as they arrive.
SENTENCES = (
    "A man is riding a bike.",
    "Two dogs are playing in the snow.",
    "A group of people stand in front of an igloo.",
    "A little girl in a pink dress is climbing the stairs of a wooden playhouse.",
    "The woman with the red hat is selling vegetables at a busy market in the city.",
    "Children are playing soccer on a field.",
    "An old man sits on a bench and reads a newspaper while pigeons walk around him.",
    "A chef is cooking in a restaurant kitchen.",
)
# The command before it shared the cores: no sharing, libgomp's spin count when OMP_WAIT_POLICY is unset.
OLD = {"AIAYN_SHARE_CPUS": "0", "GOMP_SPINCOUNT": "300000"}


@dataclass
class Policy:
    name: str
    env: dict[str, str]  # added to the environment, every setting in USER_SPIN_SETTINGS removed first
    a_alone: list[float] = field(default_factory=list)  # A's wall seconds
    a_alone_loop: list[float] = field(default_factory=list)  # A's training-loop seconds
    a_shared: list[float] = field(default_factory=list)
    a_shared_loop: list[float] = field(default_factory=list)
    a_shared_cut: bool = False  # a shared run hit its time limit: its figure is a lower bound
    b_alone: list[float] = field(default_factory=list)  # B's sentences per second
    b_shared: list[float] = field(default_factory=list)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in USER_SPIN_SETTINGS}
        env.update(self.env)
        return env

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.env.items()) or "(the command's default)"


def parse_policy(text: str) -> Policy:
    """``NAME:VAR=VALUE[,VAR=VALUE]`` -> a Policy."""
    name, _, assignments = text.partition(":")
    env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
    if not name or not env:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME:VAR=VALUE[,VAR=VALUE], e.g. spin10k:GOMP_SPINCOUNT=10000")
    return Policy(name, env)


def aiayn(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiayn", *args]


class Translator:
    """Job B: ``aiayn translate`` fed sentences without pause; the time of each output line."""

    def __init__(self, env: dict[str, str], model: str) -> None:
        self.proc = subprocess.Popen(aiayn("translate", "--model", model, "-"), cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.times: list[float] = []  # time.monotonic() of each translated line
        self.stop = threading.Event()
        self.first = threading.Event()
        self.threads = [threading.Thread(target=self._feed, daemon=True),
                        threading.Thread(target=self._read, daemon=True)]
        for t in self.threads:
            t.start()

    def _feed(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                self.proc.stdin.write(SENTENCES[i % len(SENTENCES)] + "\n")  # blocks while B is behind
                self.proc.stdin.flush()
                i += 1
        except (BrokenPipeError, OSError, ValueError):  # B ended
            pass

    def _read(self) -> None:
        for _ in self.proc.stdout:
            self.times.append(time.monotonic())
            self.first.set()
        self.first.set()  # B ended (perhaps failed): wake the waiter

    def wait_warm(self, timeout: float) -> None:
        if not self.first.wait(timeout) or self.proc.poll() is not None:
            self.close()
            raise SystemExit(f"aiayn translate produced nothing in {timeout:.0f} s: {self.proc.stderr.read()[-800:]}")

    def rate(self, start: float, end: float) -> float:
        """Sentences per second translated between ``start`` and ``end`` (time.monotonic())."""
        return sum(start < t <= end for t in self.times) / (end - start)

    def rate_alone(self, window: float) -> float:
        """B's rate over at least ``window`` seconds and 3 sentences (a slow B, at most 10 windows)."""
        start = time.monotonic()
        while (time.monotonic() - start < window or sum(t > start for t in self.times) < 3) \
                and time.monotonic() - start < 10 * window and self.proc.poll() is None:
            time.sleep(0.05)
        return self.rate(start, time.monotonic())

    def close(self) -> None:
        self.stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def train(env: dict[str, str], steps: int | None, timeout: float | None) -> tuple[float, float, bool]:
    """Job A: (wall seconds, training-loop seconds, stopped at ``timeout``)."""
    with tempfile.TemporaryDirectory(prefix="aiayn-shared-") as tmp:
        run_dir = Path(tmp) / "run"
        start = time.monotonic()
        try:
            limit = ("--max-steps", str(steps)) if steps else ()
            done = subprocess.run(aiayn("train", "--run-dir", str(run_dir), *limit, "--no-progress"),
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return time.monotonic() - start, float("nan"), True
        wall = time.monotonic() - start
        if done.returncode != 0:
            raise SystemExit(f"aiayn train failed ({done.returncode}): {done.stderr[-800:]}")
        loop = json.loads((run_dir / "summary.json").read_text())["seconds"]
        return wall, loop, False


def other_aiayn_jobs() -> int:
    """Busy aiayn processes of this user now (aiayn/cpu_share.py's registry): under the ``aiayn``
    policy, A "alone" shares the cores with these too."""
    folder = cpu_share.registry_folder()
    return cpu_share.CpuShare(folder).busy_processes(time.time()) if folder is not None else 0


def one_round(policy: Policy, args: argparse.Namespace) -> None:
    env = policy.environment()
    others = other_aiayn_jobs()
    wall, loop, _ = train(env, args.steps, None)
    policy.a_alone.append(wall)
    policy.a_alone_loop.append(loop)

    translator = Translator(env, args.model)
    try:
        translator.wait_warm(args.warm_timeout)
        policy.b_alone.append(translator.rate_alone(args.window))

        start = time.monotonic()  # B is warm: now A beside it
        wall, loop, cut = train(env, args.steps, args.timeout_factor * statistics.median(policy.a_alone))
        policy.b_shared.append(translator.rate(start, time.monotonic()))
    finally:
        translator.close()
    policy.a_shared.append(wall)
    policy.a_shared_loop.append(loop)
    policy.a_shared_cut |= cut
    print(f"  round: {policy.name}: A alone {policy.a_alone[-1]:.1f} s, beside B {wall:.1f} s{' (cut)' if cut else ''}; "
          f"B {policy.b_alone[-1]:.2f} -> {policy.b_shared[-1]:.2f} sentences/s; load {os.getloadavg()[0]:.2f}; "
          f"other busy aiayn jobs {others}",
          flush=True)


def report(policies: Sequence[Policy], args: argparse.Namespace) -> None:
    size = f"{args.steps} steps" if args.steps else "the default run"
    header(f"Sharing a machine: `aiayn train` (reverse, {size}) beside `aiayn translate` (beam search, "
           f"{args.model}); each job at the command's default thread count, {args.repeats} interleaved round(s)",
           args)
    rows = []
    for p in policies:
        cut = ">=" if p.a_shared_cut else ""
        rows.append([p.name, p.describe(), spread_text(p.a_alone), f"{cut}{spread_text(p.a_shared)}",
                     f"**{cut}{median_ratio(p.a_shared, p.a_alone):.2f}x**", spread_text(p.a_alone_loop),
                     spread_text(p.a_shared_loop), spread_text(p.b_alone, 2), spread_text(p.b_shared, 2),
                     f"{median_ratio(p.b_alone, p.b_shared):.2f}x"])
    print(table(["policy", "environment", "A alone s", "A beside B s", "A slowdown", "A loop alone s",
                 "A loop beside B s", "B alone sent/s", "B beside A sent/s", "B slowdown"], rows) + "\n")
    old = next((p for p in policies if p.name == "old"), None)
    for p in policies:
        if old is not None and p is not old:
            print(f"{p.name} / old, alone (1.00 = no loss): A's wall time {median_ratio(p.a_alone, old.a_alone):.2f}, "
                  f"A's loop {median_ratio(p.a_alone_loop, old.a_alone_loop):.2f}, "
                  f"B's rate {median_ratio(p.b_alone, old.b_alone):.2f}")
    for p in policies:
        met = median_ratio(p.a_shared, p.a_alone) <= args.goal and not p.a_shared_cut
        print(f"goal A beside B <= {args.goal}x A alone, {p.name}: {'met' if met else 'not met'}")
    footer()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="A's optimiser steps (default: the default run's 1,955)")
    parser.add_argument("--window", type=float, default=15.0, help="seconds B alone is measured over (default 15)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds per policy (default 2)")
    parser.add_argument("--model", default="multi30k-en-de", help="B's shipped translation model")
    parser.add_argument("--policy", type=parse_policy, action="append", default=[],
                        help="another candidate, NAME:VAR=VALUE[,VAR=VALUE] (repeatable)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these policies, by name")
    parser.add_argument("--timeout-factor", type=float, default=8.0,
                        help="stop A beside B after this many times A alone (default 8)")
    parser.add_argument("--warm-timeout", type=float, default=300.0, help="B's limit to its first sentence (s)")
    parser.add_argument("--goal", type=float, default=2.5, help="the slowdown A may take beside B (default 2.5)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test sizes: 20 steps, 2 s window, 1 round, A beside B stopped at 4x")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.window, args.repeats = min(args.steps or 20, 20), min(args.window, 2.0), 1
        args.timeout_factor = min(args.timeout_factor, 4.0)
    policies = [Policy("old", dict(OLD)), Policy("aiayn", {}), Policy("passive", {"AIAYN_SHARE_CPUS": "0", "OMP_WAIT_POLICY": "PASSIVE"}),
                *args.policy]
    if args.only:
        policies = [p for p in policies if p.name in args.only]
        if not policies:
            parser.error(f"--only {' '.join(args.only)}: no such policy")
    args.threads = "each job's default"  # (the header's thread count: the jobs choose their own)
    mark_start(args)
    for _ in range(args.repeats):
        for policy in policies:
            one_round(policy, args)
    report(policies, args)


if __name__ == "__main__":
    main()
