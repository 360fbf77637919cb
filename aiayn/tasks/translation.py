"""Machine translation, the paper's own job: parallel text -> joint BPE -> encoder-decoder -> sacreBLEU.

The corpus is a directory of ``{split}.{lang}`` files (default ``$AIAYN_DATA_DIR/multi30k``:
Multi30k task 1, train / val / test2016). A joint source+target BPE vocabulary is learned on the
training split with the ``tokenizers`` library and saved as ``tokenizer.json`` in the run
directory (a resumed run or ``aiayn translate`` reads it back). Training batches hold up to
``max_tokens`` padded tokens of similar-length pairs. Validation reports teacher-forced loss and
greedy BLEU; the test split is scored with beam search, sacreBLEU BLEU (with its signature) and chrF.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ConfigError, ModelConfig
from aiayn.data import data_dir, fetch_hint
from aiayn.data.parallel import (
    BucketSpec,
    DataError,
    MissingDataError,
    pad_batch,
    read_parallel,
    split_paths,
    token_batches,
)
from aiayn.tasks.base import register
from aiayn.tokenizers import BPETokenizer
from aiayn.train.losses import IGNORE, LossInput
from aiayn.train.task import AttentionExample, Batch, Task, encoder_decoder_example
from aiayn.translate import DecodeOptions, Translator

TOKENIZER_FILE = "tokenizer.json"


def corpus_score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """sacreBLEU BLEU and chrF of detokenised hypotheses against one reference each, and the
    lower-cased BLEU (``bleu_lc``): sacreBLEU's 13a tokenisation of lower-cased text, the figure
    comparable with papers that report lower-cased *tokenised* BLEU (Wu et al. 2021 on Multi30k)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, bleu_lc, chrf = BLEU(), BLEU(lowercase=True), CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    lc_score = bleu_lc.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {"bleu": bleu_score.score, "chrf": chrf_score.score, "bleu_lc": lc_score.score,
            "bleu_text": str(bleu_score), "bleu_signature": str(bleu.get_signature()),
            "bleu_lc_signature": str(bleu_lc.get_signature()), "chrf_signature": str(chrf.get_signature())}


@register
class TranslationTask(Task):
    name = "translation"
    attention_kinds = ("cross", "encoder", "decoder")
    description = "machine translation on parallel text (default Multi30k en->de), BPE, beam search, sacreBLEU"

    def __init__(self, *, src_lang: str = "en", tgt_lang: str = "de", corpus: str = "multi30k",
                 corpus_dir: str | None = None, vocab_size: int = 8000, max_tokens: int = 4096,
                 max_len: int = 128, train_split: str = "train", val_split: str = "val",
                 test_split: str = "test2016", val_bleu: bool = True, beam_size: int = 5,
                 length_penalty: float = 0.6, **options: Any) -> None:
        super().__init__(src_lang=src_lang, tgt_lang=tgt_lang, corpus=corpus, corpus_dir=corpus_dir,
                         vocab_size=vocab_size, max_tokens=max_tokens, max_len=max_len,
                         train_split=train_split, val_split=val_split, test_split=test_split,
                         val_bleu=val_bleu, beam_size=beam_size, length_penalty=length_penalty,
                         **options)
        if options:
            known = sorted(inspect.signature(TranslationTask.__init__).parameters)
            raise ConfigError(f"unknown translation task option(s) {', '.join(sorted(options))}; known: "
                              f"{', '.join(k for k in known if k not in ('self', 'options'))}")
        if src_lang == tgt_lang:
            raise DataError(f"source and target language are both {src_lang!r}")
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.corpus_dir = corpus_dir
        self.vocab_size, self.max_tokens, self.max_len = vocab_size, max_tokens, max_len
        self.split_names = {"train": train_split, "val": val_split, "test": test_split}
        self.test_split = "test"
        self.val_bleu = val_bleu
        self.decode = DecodeOptions(beam_size=beam_size, length_penalty=length_penalty)
        self.tokenizer: BPETokenizer | None = None
        self.ids: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
        self.text: dict[str, tuple[list[str], list[str]]] = {}

    # ---- recipe ---------------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The model of ``recipes/multi30k-en-de.yaml`` (Transformer-tiny, Wu et al. 2021: 4 + 4
        layers, d_model 128, 4 heads, d_ff 256), measured there at 39.2 BLEU on test2016; a recipe
        overrides any field. tests/integration/test_translation_defaults.py keeps the two equal."""
        return ModelConfig(
            arch="encoder-decoder", vocab_size=self.vocab_size, d_model=128, n_heads=4, n_layers=4,
            n_decoder_layers=4, d_ff=256, activation="relu", norm_position="post",
            positional="sinusoidal", dropout=0.3, attention_dropout=0.1, activation_dropout=0.1,
            max_seq_len=self.max_len, share_embeddings=True, tie_output=True, pad_id=0,
            name=f"{self.src_lang}-{self.tgt_lang}")

    def train_overrides(self) -> dict[str, Any]:
        """The training settings of ``recipes/multi30k-en-de.yaml``: a peak learning rate of 3e-3
        after 600 warmup steps, then a cosine decay. (Until issue 23 the default was the Noam
        schedule with ``lr=1e-3`` read as its factor: a peak of about 1e-6, which learned nothing.)"""
        return dict(epochs=80, lr=3e-3, schedule="cosine", warmup_steps=600, optimizer="adam",
                    label_smoothing=0.1, clip_grad_norm=1.0, keep_checkpoints=5, average_last=5)

    # ---- data -----------------------------------------------------------------------------------
    def root(self) -> Path:
        return Path(self.corpus_dir) if self.corpus_dir else data_dir() / self.options["corpus"]

    def load_tokenizer(self) -> BPETokenizer:
        """The run's tokenizer.json (needs ``run_dir``)."""
        if self.tokenizer is None:
            if self.run_dir is None or not (self.run_dir / TOKENIZER_FILE).is_file():
                raise DataError(f"no {TOKENIZER_FILE} in run directory {self.run_dir}; "
                                f"is it a translation run?")
            self.tokenizer = BPETokenizer.load(self.run_dir / TOKENIZER_FILE)
        return self.tokenizer

    def prepare(self, seed: int) -> None:
        root = self.root()
        for split, name in self.split_names.items():
            paths = split_paths(root, name, self.src_lang, self.tgt_lang)
            self._check_present(paths)
            self.text[split] = read_parallel(*paths)
        saved = self.run_dir / TOKENIZER_FILE if self.run_dir is not None else None
        if saved is not None and saved.is_file():
            self.tokenizer = BPETokenizer.load(saved)
        else:  # one joint vocabulary: shared embeddings need it
            src, tgt = self.text["train"]
            self.tokenizer = BPETokenizer.train([*src, *tgt], vocab_size=self.vocab_size)
            if saved is not None:
                self.tokenizer.save(saved)
        if self.tokenizer.vocab_size > self.vocab_size:
            raise DataError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                            f"{self.vocab_size}")
        eos = self.tokenizer.eos_id
        for split, (src, tgt) in self.text.items():
            src_ids, tgt_ids = self.tokenizer.encode_batch(src), self.tokenizer.encode_batch(tgt)
            # + </s>; pairs longer than the model's maximum are cut (training) — rare by design.
            cut = self.max_len - 1
            self.ids[split] = ([[*s[:cut], eos] for s in src_ids], [[*t[:cut], eos] for t in tgt_ids])

    def _check_present(self, paths: tuple[Path, Path]) -> None:
        """A missing corpus file names the command that fetches the corpus (the default root only:
        a corpus_dir of the user's own is theirs to fill)."""
        for path in paths:
            if not path.is_file():
                hint = ("give the task option corpus_dir the folder that holds it" if self.corpus_dir
                        else fetch_hint(self.options["corpus"]))
                raise MissingDataError(f"{path} not found; {hint}")

    def split_size(self, split: str) -> int:
        return len(self.ids[split][0])

    def lengths(self, split: str) -> tuple[Tensor, Tensor]:
        src, tgt = self.ids[split]
        return torch.tensor([len(s) for s in src]), torch.tensor([len(t) for t in tgt])

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[Tensor]:
        """Length-bucketed batches of up to ``max_tokens`` padded tokens (``batch_size`` is unused)."""
        return token_batches(*self.lengths("train"), BucketSpec(self.max_tokens), seed=seed, epoch=epoch)

    def memory_batches(self, batches: list[Tensor]) -> list[Tensor]:
        """The batch of the most pairs and the one of the longest pair: each holds up to
        ``max_tokens`` padded tokens, the longest pair's the largest attention masks."""
        if not batches:
            return []
        longest_side = torch.maximum(*self.lengths("train"))  # (pairs,)
        longest = max(batches, key=lambda indices: int(longest_side[indices].max()))
        return [max(batches, key=len), longest]

    def eval_batches(self, split: str, batch_size: int) -> list[Batch]:
        spec = BucketSpec(self.max_tokens)
        return [self.collate(split, b) for b in token_batches(*self.lengths(split), spec, seed=None)]

    def collate(self, split: str, indices: Tensor) -> Batch:
        """src (b, s) = x + </s>; tgt_in (b, t) = <s> + y; tgt_out (b, t) = y + </s>; right-padded."""
        assert self.tokenizer is not None
        src_ids, tgt_ids = self.ids[split]
        pad, bos = self.tokenizer.pad_id, self.tokenizer.bos_id
        rows = indices.tolist()
        tgt = [tgt_ids[i] for i in rows]
        return {"src": pad_batch([src_ids[i] for i in rows], pad),
                "tgt_in": pad_batch([[bos, *t[:-1]] for t in tgt], pad),
                "tgt_out": pad_batch(tgt, pad)}

    def count_tokens(self, batch: Batch) -> int:
        pad = self.tokenizer.pad_id if self.tokenizer else 0
        return int((batch["src"] != pad).sum() + (batch["tgt_out"] != pad).sum())

    # ---- model I/O ------------------------------------------------------------------------------
    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        targets = batch["tgt_out"].masked_fill(batch["tgt_out"] == self.tokenizer.pad_id, IGNORE)
        # The model's output, not its logits: the loss runs the output layer over the real target
        # tokens only when the model skips padding, fused with the cross-entropy under aiayn.fast.
        return model(batch["src"], batch["tgt_in"]), targets

    def translator(self, model: nn.Module) -> Translator:
        """A ``Translator`` of ``model`` that searches as this run's test split is scored (its beam
        size and length penalty) unless told otherwise."""
        return Translator(model, self.load_tokenizer(), max_tokens=self.max_tokens, options=self.decode)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str, batch_size: int = 500) -> dict[str, float]:
        """Teacher-forced loss/accuracy; BLEU and chrF (greedy on val, beam search on test)."""
        metrics = super().evaluate(model, split, batch_size)
        if split == "val" and not self.val_bleu:
            return metrics
        options = self.decode if split == "test" else DecodeOptions(beam_size=1)
        sources, references = self.text[split]
        hypotheses = self.translator(model).translate(sources, options)
        scores = corpus_score(hypotheses, references)
        metrics.update(bleu=scores["bleu"], chrf=scores["chrf"])
        if split == "test" and self.run_dir is not None:
            name = self.split_names["test"]
            (self.run_dir / f"hypotheses.{name}.{self.tgt_lang}").write_text(
                "\n".join(hypotheses) + "\n", encoding="utf-8")
            (self.run_dir / f"score.{name}.json").write_text(json.dumps(
                {**scores, "beam_size": options.beam_size, "length_penalty": options.length_penalty},
                indent=2) + "\n", encoding="utf-8")
        return metrics

    def examples(self, model: nn.Module, n: int = 3) -> list[str]:
        sources, references = self.text["test"]
        hypotheses = self.translator(model).translate(sources[:n], self.decode)
        return [f"{s}  ->  {h}  (reference: {r})"
                for s, h, r in zip(sources[:n], hypotheses, references[:n], strict=True)]

    @torch.no_grad()
    def attention_example(self, model: nn.Module, text: str | None = None,
                          kind: str | None = None) -> AttentionExample:
        """The maps of one sentence (``text``, or the first test source) and its greedy translation."""
        kind = self.attention_kind(kind)
        model.eval()
        tok = self.load_tokenizer()
        source = text if text is not None else self.text["test"][0][0]
        translator = self.translator(model)
        src_ids = translator.source_ids(source)
        tgt_ids = translator.translate_ids([src_ids], DecodeOptions(beam_size=1))[0]
        src = pad_batch([src_ids], tok.pad_id)
        tgt_in = pad_batch([[tok.bos_id, *tgt_ids]], tok.pad_id)
        on_model = self.on_model(model, {"src": src, "tgt_in": tgt_in})
        out = model(on_model["src"], on_model["tgt_in"], need_weights=True)
        label = tok.tokenizer.id_to_token
        return encoder_decoder_example(out, kind, [label(i) for i in src_ids],
                                       [label(i) for i in [tok.bos_id, *tgt_ids]],
                                       f"{self.src_lang}->{self.tgt_lang}")
