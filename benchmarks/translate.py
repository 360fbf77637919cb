"""Translation speed: aiayn's Translator against Hugging Face ``MarianMTModel.generate``.

Both models have the size of the committed Multi30k recipe (``recipes/multi30k-en-de.yaml``:
Transformer-tiny, d_model 128, 4 heads, 4+4 layers, d_ff 256, ReLU, post-norm, shared + tied 8k
vocabulary; ``--d-model/--heads/--layers/--d-ff`` set another) and random weights; both get the same source ids (the first
N sentences of test2016, BPE-encoded with a tokenizer learned on the training split) and may emit up
to the same number of target tokens. Random weights almost never pick </s>, so both decode to the
limit: the work is equal, and the printed mean output lengths show it.

Measured: sentences/s for greedy and beam 5, at batch 1 and 64, medians of --repeats runs with the
two implementations interleaved, in one process and on the same threads. aiayn's model runs through
``aiayn.fast.optimize(model, "inference")``, as ``aiayn translate`` runs it.

    python -m benchmarks.translate                 # 2 threads, 64 sentences, 3 repeats
    python -m benchmarks.translate --quick         # a smoke run
    python -m benchmarks.translate --compile       # and aiayn with compile=True (compiled in the warm-up)

``--compile`` adds an "aiayn compiled" column: the same Translator with ``DecodeOptions(compile=True)``
(greedy and beam search's steps after the first through ``aiayn.fast.compiled_decode``), its
graphs compiled in the warm-up call, untimed, and the ratio compiled / eager.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def build_models(vocab: int, max_len: int, *, d_model: int, heads: int, layers: int,
                 d_ff: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import MarianConfig, MarianMTModel

    from aiayn.config import ModelConfig
    from aiayn.fast import optimize
    from aiayn.models import build_model

    ours = build_model(ModelConfig(
        arch="encoder-decoder", vocab_size=vocab, d_model=d_model, n_heads=heads, n_layers=layers,
        n_decoder_layers=layers, d_ff=d_ff, activation="relu", norm_position="post", positional="sinusoidal",
        max_seq_len=max_len, share_embeddings=True, tie_output=True, pad_id=0)).eval()
    optimize(ours, mode="inference")
    theirs = MarianMTModel(MarianConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, activation_function="relu",
        max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)).eval()
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 sentences, 1 repeat")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    parser.add_argument("--d-ff", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="also aiayn with compile=True")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="beam sizes (1: greedy)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="batch sizes")
    args = parser.parse_args()
    if args.quick:
        args.sentences, args.repeats = 8, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from aiayn.data import data_dir
    from aiayn.data.parallel import pad_batch, read_lines
    from aiayn.tokenizers import BPETokenizer
    from aiayn.translate import DecodeOptions, Translator

    root = data_dir() / "multi30k"
    tokenizer = BPETokenizer.train([*read_lines(root / "train.en"), *read_lines(root / "train.de")],
                                   vocab_size=8000)
    sentences = read_lines(root / "test2016.en")[: args.sentences]
    ours, theirs = build_models(8000, 128, d_model=args.d_model, heads=args.heads, layers=args.layers,
                                d_ff=args.d_ff)
    translator = Translator(ours, tokenizer, max_tokens=100_000, max_sentences=64)
    sources = [translator.source_ids(s) for s in sentences]
    n_aiayn = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    print(f"parameters: aiayn {n_aiayn:,}, Marian {n_hf:,} (Marian adds its final_logits_bias buffer); "
          f"{len(sentences)} sentences, {args.threads} threads, float32")
    # The same target budget for both: fairseq's 1.2 * source + 10, per batch the longest source's.
    a, b = 1.2, 10

    def run_aiayn(beam: int, batch: int, compile: bool = False) -> tuple[float, float]:
        lengths = []
        start = time.perf_counter()
        for i in range(0, len(sources), batch):
            chunk = sources[i : i + batch]
            budget = int(a * max(len(s) for s in chunk)) + b
            out = translator.translate_ids(chunk, DecodeOptions(beam_size=beam, max_len_a=0, max_len_b=budget,
                                                                      keep_greedy=False, compile=compile))
            lengths += [len(o) for o in out]
        return time.perf_counter() - start, statistics.mean(lengths)

    @torch.inference_mode()
    def run_hf(beam: int, batch: int) -> tuple[float, float]:
        lengths = []
        start = time.perf_counter()
        for i in range(0, len(sources), batch):
            chunk = sources[i : i + batch]
            src = pad_batch(chunk, 0)
            budget = int(a * max(len(s) for s in chunk)) + b
            out = theirs.generate(input_ids=src, attention_mask=src != 0, num_beams=beam, do_sample=False,
                                  max_new_tokens=budget)
            # tokens after the decoder start, up to </s> or padding (random weights repeat any id)
            lengths += [int(((row[1:] != 0) & (row[1:] != 2)).sum()) for row in out]
        return time.perf_counter() - start, statistics.mean(lengths)

    rows = []
    compiled_rows = []
    for beam in args.beams:
        for batch in args.batches:
            batch = min(batch, len(sources))
            runners: dict[str, Callable[[int, int], tuple[float, float]]] = {"aiayn": run_aiayn, "hf": run_hf}
            if args.compile:
                runners["compiled"] = lambda beam, batch: run_aiayn(beam, batch, compile=True)
            times: dict[str, list[float]] = {name: [] for name in runners}
            mean_len: dict[str, float] = {}
            if args.compile:  # its graphs compile here, untimed
                runners["compiled"](beam, batch)
            if not args.quick:  # warm-up
                for fn in runners.values():
                    fn(beam, batch)
            for _ in range(args.repeats):  # interleaved: A, B, A, B ...
                for name, fn in runners.items():
                    seconds, mean_len[name] = fn(beam, batch)
                    times[name].append(seconds)
            ours_sps = len(sources) / statistics.median(times["aiayn"])
            hf_sps = len(sources) / statistics.median(times["hf"])
            rows.append((beam, batch, ours_sps, hf_sps, mean_len["aiayn"], mean_len["hf"]))
            print(f"beam {beam} batch {batch:>2}: aiayn {ours_sps:7.1f} sent/s  Marian {hf_sps:7.1f} sent/s  "
                  f"ratio {ours_sps / hf_sps:5.2f}x  (mean output tokens {mean_len['aiayn']:.1f} vs "
                  f"{mean_len['hf']:.1f})", flush=True)
            if args.compile:
                compiled_sps = len(sources) / statistics.median(times["compiled"])
                compiled_rows.append((beam, batch, ours_sps, compiled_sps))
                print(f"beam {beam} batch {batch:>2}: aiayn compiled {compiled_sps:7.1f} sent/s, "
                      f"{compiled_sps / ours_sps:5.2f}x eager (mean output tokens {mean_len['compiled']:.1f})",
                      flush=True)
    print("\n| decoding | batch | aiayn sent/s | Marian sent/s | ratio |\n|---|---|---|---|---|")
    for beam, batch, ours_sps, hf_sps, _, _ in rows:
        print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {batch} | {ours_sps:.1f} | {hf_sps:.1f} | "
              f"{ours_sps / hf_sps:.2f}x |")
    if compiled_rows:
        print("\n| decoding | batch | aiayn sent/s | aiayn compiled sent/s | compiled / eager |\n|---|---|---|---|---|")
        for beam, batch, ours_sps, compiled_sps in compiled_rows:
            print(f"| {'greedy' if beam == 1 else f'beam {beam}'} | {batch} | {ours_sps:.1f} | {compiled_sps:.1f} | "
                  f"{compiled_sps / ours_sps:.2f}x |")


if __name__ == "__main__":
    main()
