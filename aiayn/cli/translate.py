"""``aiayn translate``, ``evaluate`` and ``fetch-multi30k`` (the old name of ``aiayn fetch multi30k``):
translation runs."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from aiayn.cli.app import (
    SEED_RANGE,
    FiniteFloatRange,
    bad_value,
    check_writable,
    cli,
    device_option,
    options,
    place,
    plain_option,
    threads_option,
    utf8_text,
)
from aiayn.cli.finetune import adapter_option
from aiayn.cli.generate import text_model

_decoding_options = options(
    click.option("--run", "run_dirs", type=click.Path(path_type=Path), multiple=True,
                 help="A run directory of the translation task. Repeat it (or add --model) for an "
                      "ensemble: one search over the mean of the models' log-probabilities; they "
                      "must share the vocabulary (source and target tokenizers) and the language pair."),
    click.option("--model", "model_names", multiple=True,
                 help="A shipped model (multi30k-en-de, multi30k-de-en; see `aiayn models`) or a "
                      "release directory; repeat it for an ensemble.  [default without --run: "
                      "multi30k-en-de]"),
    click.option("--checkpoint", "checkpoints", type=click.Path(path_type=Path), multiple=True,
                 help="A checkpoint directory (e.g. RUN/averaged-last5) instead of the run's latest. "
                      "Repeated with one --run: an ensemble of that run's checkpoints; with several "
                      "--run: one each, in order."),
    click.option("--beam", type=click.IntRange(min=1),
                 help="Beam size; 1 = greedy.  [default: the run's recipe, beam_size (5 if unset)]"),
    click.option("--length-penalty", type=FiniteFloatRange(min=0),
                 help="GNMT length penalty alpha: score / ((5 + length) / 6) ** alpha.  "
                      "[default: the run's recipe, length_penalty (0.6 if unset)]"),
    click.option("--temperature", type=FiniteFloatRange(min=0),
                 help="Sample instead of searching, at this temperature."),
    click.option("--top-k", type=click.IntRange(min=1), help="Sample among the k most likely tokens."),
    click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True),
                 help="Nucleus sampling threshold."),
    click.option("--seed", type=SEED_RANGE, help="Random seed for sampling, 0 to 2**32 - 1."),
    click.option("--compile", "compiled", is_flag=True,
                 help="Run the decode steps after the first as one torch.compile'd graph (a CUDA graph "
                      "on a GPU). The same translations; each batch size compiles once (about a minute "
                      "on the CPU, with a C++ compiler), so it pays for many sentences, not a few "
                      "(docs/gpu.md)."),
    click.option("--prompt", help="Translate with a chat model (--model: a GGUF file, a Hugging Face "
                                  "directory or a language-model run) asked this, where {src} stands for "
                                  "the sentence, e.g. 'Translate to German: {src}'; greedy, the answer's "
                                  "first line."),
    adapter_option,
    plain_option,
    device_option,
    threads_option,
)


def _translator(device: Any, run_dirs: tuple[Path, ...], model_names: tuple[str, ...],
                checkpoints: tuple[Path, ...], plain: bool, beam: int | None, compiled: bool,
                prompt: str | None, adapter: Path | None, **decoding: Any) -> tuple[Any, Any]:
    """(``Translator``, ``DecodeOptions``) of --run / --model / --checkpoint on ``device``; beam size and
    length penalty default to the first run's recipe; several models make an ensemble. With --prompt:
    (``PromptTranslator``, None)."""
    from aiayn.tasks.runs import RunInputError, load_ensemble_translator
    from aiayn.tasks.trained import DEFAULT_TRANSLATION_MODEL, resolve_model
    from aiayn.translate import decode_options

    if prompt is not None:
        return _prompt_translator(device, run_dirs, model_names, checkpoints, plain, prompt, adapter,
                                  beam=beam, compile=compiled, **decoding), None
    if adapter is not None:
        raise click.UsageError("--adapter goes with --prompt (a chat model with a LoRA adapter); a translation "
                               "run keeps its own adapters")
    try:
        sources = [*run_dirs, *(resolve_model(name) for name in model_names)]
        sources = sources or [resolve_model(DEFAULT_TRANSLATION_MODEL)]
        if not checkpoints:
            members = [(source, None) for source in sources]
        elif len(sources) == 1:  # several checkpoints of one run
            members = [(sources[0], checkpoint) for checkpoint in checkpoints]
        elif len(checkpoints) == len(sources):
            members = list(zip(sources, checkpoints, strict=True))
        else:
            raise click.UsageError(f"{len(checkpoints)} --checkpoint for {len(sources)} models; give one per "
                                   f"--run (in order), or several with a single --run")
        task, translator = load_ensemble_translator(members, plain=plain, device=device)
    except RunInputError as exc:
        if exc.about == "members":  # about the models together, not one option
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=f"--{exc.about}") from None
    return translator, decode_options(task.decode, beam_size=beam, compile=compiled, **decoding)


def _prompt_translator(device: Any, run_dirs: tuple[Path, ...], model_names: tuple[str, ...],
                       checkpoints: tuple[Path, ...], plain: bool, prompt: str, adapter: Path | None,
                       **decoding: Any) -> Any:
    """--prompt's ``PromptTranslator`` over the one chat model given (with --adapter); what it does not
    take refused."""
    from aiayn.serve.offline import PromptTranslator

    refused = [f"--{k.replace('_', '-')}" for k, v in decoding.items() if v not in (None, False)]
    refused += ["--checkpoint"] if checkpoints else []
    given = len(run_dirs) + len(model_names)
    problem = (f"drop {', '.join(refused)}" if refused else f"drop {given} models" if given > 1
               else "give --model" if given == 0 and adapter is None else None)
    if problem is not None:
        raise click.UsageError(f"--prompt translates greedily with one chat model (--model or --run); {problem}")
    with bad_value("--prompt"):
        lm = text_model(run_dirs[0] if run_dirs else None, model_names[0] if model_names else None, plain=plain,
                        device=device, adapter=adapter, run_error_names_model=True)
        return PromptTranslator(lm, prompt)


@cli.command("translate")
@_decoding_options
@click.argument("texts", nargs=-1, callback=utf8_text)
def translate_cmd(device: str, threads: int | None, texts: tuple[str, ...], **options: Any) -> None:
    """Translate TEXTS, or each line of standard input as it arrives (one output line per input line;
    TEXTS "-" reads standard input too).

    A sentence longer than the model's maximum is cut to fit, with a warning on stderr. Several
    --model / --run / --checkpoint translate with an ensemble of them (docs/translation.md).
    """
    import warnings

    from aiayn.translate import InputTooLongWarning

    translator, decoding = _translator(place(device, threads), **options)
    if texts == ("-",):  # "-" is standard input, as for aiayn embed
        texts = ()
    with warnings.catch_warnings():  # each cut sentence says so, in one line (even with --debug)
        warnings.simplefilter("always", InputTooLongWarning)
        warnings.showwarning = lambda warning, *_, **__: click.echo(f"warning: {warning}", err=True)
        if texts:
            for line in translator.translate(list(texts), decoding):
                click.echo(line)
            return
        for number, raw in enumerate(sys.stdin.buffer, start=1):  # streamed: translated as read
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise click.UsageError(f"standard input, line {number}: not UTF-8 (byte 0x{raw[exc.start]:02x} at "
                                       f"column {exc.start + 1}); give UTF-8 text") from None
            click.echo(translator.translate([line], decoding)[0])
            sys.stdout.flush()


@cli.command("evaluate")
@_decoding_options
@click.option("--src", "src_path", required=True, type=click.Path(path_type=Path), help="Source sentences, one per line.")
@click.option("--ref", "ref_path", required=True, type=click.Path(path_type=Path), help="Reference translations, aligned.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the hypotheses (detokenised, one per line) here.")
def evaluate_cmd(device: str, threads: int | None, src_path: Path, ref_path: Path, out_path: Path | None,
                 **options: Any) -> None:
    """Translate --src and score it against --ref: sacreBLEU BLEU (with its signature) and chrF.

    Several --model / --run / --checkpoint score an ensemble of them."""
    from aiayn.data.parallel import read_parallel
    from aiayn.generate import Ensemble
    from aiayn.tasks.translation import corpus_score
    from aiayn.train.checkpoint import atomic_write_text

    where = place(device, threads)
    sources, references = read_parallel(src_path, ref_path)
    if out_path is not None:  # fail now, not after the whole decode
        check_writable(out_path, "--out")
    translator, decoding = _translator(where, **options)
    start = time.perf_counter()
    hypotheses = translator.translate(sources, decoding)
    seconds = time.perf_counter() - start
    scores = corpus_score(hypotheses, references)
    if out_path is not None:
        atomic_write_text(out_path, "\n".join(hypotheses) + "\n")
    click.echo(f"{scores['bleu_text']}")
    click.echo(f"BLEU signature: {scores['bleu_signature']}")
    click.echo(f"chrF2 = {scores['chrf']:.2f}  (signature: {scores['chrf_signature']})")
    click.echo(f"lower-cased BLEU = {scores['bleu_lc']:.2f}  (signature: {scores['bleu_lc_signature']})")
    how = ("greedy, the answer's first line" if decoding is None
           else f"beam {decoding.beam_size}, length penalty {decoding.length_penalty}")
    model = getattr(translator, "model", None)  # (a PromptTranslator has a text model instead)
    click.echo(f"{len(sources)} sentences in {seconds:.1f} s ({len(sources) / seconds:.1f} sentences/s), {how}"
               + (f", an ensemble of {len(model)} models" if isinstance(model, Ensemble) else "")
               + (f"; hypotheses written to {out_path}" if out_path else ""))


@cli.command("fetch-multi30k", hidden=True)  # kept so that scripts using the old name still work
@click.option("--to", "cache_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for train/val/test2016 .en/.de files (then set AIAYN_DATA_DIR to its parent, "
                   "or give the task option corpus_dir).")
def fetch_multi30k_cmd(cache_dir: Path) -> None:
    """The old name of `aiayn fetch multi30k`: download Multi30k task 1 (en-de: train, val, test2016),
    checked, into the folder --to itself (needs a network)."""
    from aiayn.data.parallel import fetch_multi30k

    click.echo(f"Multi30k in {fetch_multi30k(cache_dir)}")
