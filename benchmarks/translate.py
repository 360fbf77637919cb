"""Translation speed: aiayn's Translator against Hugging Face ``MarianMTModel.generate``.

Both at the Multi30k recipe's size with random weights, on the same test2016 source ids and output
limit (random weights rarely pick </s>: both decode to the limit). Sentences/s for greedy and beam 5
at batch 1 and 64, medians of interleaved runs; ``--compile`` adds "aiayn compiled".
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import common

# The same target budget for both: fairseq's 1.2 * source + 10, per batch the longest source's.
LEN_A, LEN_B = 1.2, 10


def aiayn_model(vocab: int, max_len: int, *, d_model: int, heads: int, layers: int, d_ff: int) -> torch.nn.Module:
    from aiayn.config import ModelConfig
    from aiayn.fast import optimize
    from aiayn.models import build_model

    ours = build_model(ModelConfig(
        arch="encoder-decoder", vocab_size=vocab, d_model=d_model, n_heads=heads, n_layers=layers,
        n_decoder_layers=layers, d_ff=d_ff, activation="relu", norm_position="post", positional="sinusoidal",
        max_seq_len=max_len, share_embeddings=True, tie_output=True, pad_id=0)).eval()
    return optimize(ours, mode="inference")


def marian_model(vocab: int, max_len: int, *, d_model: int, heads: int, layers: int, d_ff: int) -> torch.nn.Module:
    from transformers import MarianConfig, MarianMTModel

    return MarianMTModel(MarianConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, activation_function="relu",
        max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)).eval()


def aiayn_runner(translator, sources: list[list[int]], beam: int, batch: int, lengths: list[float], *,
                 compile: bool = False):
    """Translate every source in batches of ``batch``; its mean output length into ``lengths``."""
    from aiayn.translate import DecodeOptions

    def run() -> None:
        out = []
        for i in range(0, len(sources), batch):
            chunk = sources[i: i + batch]
            budget = int(LEN_A * max(len(s) for s in chunk)) + LEN_B
            out += translator.translate_ids(chunk, DecodeOptions(beam_size=beam, max_len_a=0, max_len_b=budget,
                                                                 keep_greedy=False, compile=compile))
        lengths.append(statistics.mean(len(o) for o in out))
    return run


def marian_runner(model, sources: list[list[int]], beam: int, batch: int, lengths: list[float]):
    from aiayn.data.parallel import pad_batch

    @torch.inference_mode()
    def run() -> None:
        out = []
        for i in range(0, len(sources), batch):
            chunk = sources[i: i + batch]
            src = pad_batch(chunk, 0)
            budget = int(LEN_A * max(len(s) for s in chunk)) + LEN_B
            rows = model.generate(input_ids=src, attention_mask=src != 0, num_beams=beam, do_sample=False,
                                  max_new_tokens=budget)
            # tokens after the decoder start, up to </s> or padding (random weights repeat any id)
            out += [int(((row[1:] != 0) & (row[1:] != 2)).sum()) for row in rows]
        lengths.append(statistics.mean(out))
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="also aiayn with compile=True")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="beam sizes (1: greedy)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="batch sizes")
    common.add_common_args(parser, repeats=3, warmup=1)
    args = parser.parse_args(argv)
    common.setup(args)
    if args.quick:
        args.sentences = min(args.sentences, 8)
    from aiayn.data import data_dir
    from aiayn.data.parallel import read_lines
    from aiayn.tokenizers import BPETokenizer
    from aiayn.translate import Translator

    root = data_dir() / "multi30k"
    tokenizer = BPETokenizer.train([*read_lines(root / "train.en"), *read_lines(root / "train.de")],
                                   vocab_size=8000)
    sentences = read_lines(root / "test2016.en")[: args.sentences]
    size = dict(d_model=args.d_model, heads=args.heads, layers=args.layers, d_ff=args.d_ff)
    translator = Translator(aiayn_model(8000, 128, **size), tokenizer, max_tokens=100_000, max_sentences=64)
    marian = common.load_peer("Marian (transformers)", marian_model, 8000, 128, **size)
    sources = [translator.source_ids(s) for s in sentences]
    common.header(f"Translation, {len(sentences)} sentences of test2016, random weights (d {args.d_model}, "
           f"{args.layers}+{args.layers} layers)", args)
    print(f"parameters: aiayn {common.count_params(translator.model):,}"
          + (f", Marian {common.count_params(marian):,} (and its final_logits_bias buffer)" if marian else "") + "\n")
    rows = []
    for beam in args.beams:
        for batch in (min(b, len(sources)) for b in args.batches):
            lengths: dict[str, list[float]] = {"aiayn": [], "Marian": [], "aiayn compiled": []}
            peers = [common.Timed("aiayn", aiayn_runner(translator, sources, beam, batch, lengths["aiayn"]))]
            if marian is not None:
                peers.append(common.Timed("Marian", marian_runner(marian, sources, beam, batch, lengths["Marian"])))
            if args.compile:  # its graphs compile in the warm-up, untimed
                peers.append(common.Timed("aiayn compiled", aiayn_runner(translator, sources, beam, batch,
                                                                  lengths["aiayn compiled"], compile=True)))
            common.measure(peers, args, warmup=max(args.warmup, int(args.compile)))
            rate = {p.name: len(sources) / p.median for p in peers}
            decoding = "greedy" if beam == 1 else f"beam {beam}"
            for p in peers:
                rows.append([decoding, batch, p.name, f"{rate[p.name]:.1f}", f"±{p.spread * 50:.0f}%",
                             f"{lengths[p.name][-1]:.1f}"])
            for name in (n for n in rate if n.startswith("aiayn")):
                print("* " + common.ratio_line(f"{decoding}, batch {batch}, {name} sentences/s", rate[name],
                                        {n: v for n, v in rate.items() if not n.startswith("aiayn")}), flush=True)
            if "aiayn compiled" in rate:
                print(f"* {decoding}, batch {batch}: aiayn compiled / eager = "
                      f"{rate['aiayn compiled'] / rate['aiayn']:.2f}x", flush=True)
    print()
    print(common.table(["decoding", "batch", "peer", "sentences/s (median)", "spread", "mean output tokens"], rows))
    common.footer()


if __name__ == "__main__":
    main()
