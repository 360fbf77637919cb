"""``aiayn explain [TOPIC]``: the classic questions answered by small experiments (aiayn.explain)."""

from __future__ import annotations

from pathlib import Path

import click

from aiayn.cli.app import cli, place, threads_option


@cli.command("explain")
@click.argument("topic", required=False)
@click.option("--all", "run_all", is_flag=True, help="Run every topic (and write the index page).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("explain"),
              show_default=True, help="Folder for the plots and the markdown page (TOPIC.md).")
@click.option("--quick", is_flag=True, help="Reduced sizes (what the tests run): seconds, rougher numbers.")
@click.option("--device", default="auto", metavar="DEVICE",
              help="Where the topics that train (additive, shared-qk) train: auto (the first CUDA GPU, else the "
                   "CPU), cpu, cuda, cuda:N or mps; the other topics measure functions on the CPU.  [default: auto]")
@threads_option
def explain_cmd(topic: str | None, run_all: bool, out: Path, quick: bool, device: str,
                threads: int | None = None) -> None:
    """Answer a classic question about the Transformer by an experiment: print its tables, write
    its plot and its page. Without TOPIC: list the topics."""
    from aiayn.explain import TOPICS, index_page, run_topic
    from aiayn.explain import topic as topic_module

    if topic is None and not run_all:
        for name in TOPICS:
            click.echo(f"{name:11s} {topic_module(name).QUESTION}")
        return
    if topic is not None and run_all:
        raise click.UsageError("give a TOPIC or --all, not both")
    if topic is not None and topic not in TOPICS:
        raise click.BadParameter(f"unknown topic {topic!r}; topics: {', '.join(TOPICS)}", param_hint="TOPIC")
    where = place(device, threads)  # the timed topics' figures are for this thread count
    for name in TOPICS if run_all else [topic]:
        command = f"aiayn explain {name} --out {out}" + (" --quick" if quick else "")
        report = run_topic(name, out, quick=quick, command=command, device=where)
        click.echo(report.printable())
        click.echo(f"page: {out / (name + '.md')} ({report.seconds:.0f} s)\n")
    if run_all:
        click.echo(f"index: {index_page(out)}")
