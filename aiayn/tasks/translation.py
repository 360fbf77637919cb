"""Machine translation, the paper's own job: parallel text -> BPE -> encoder-decoder -> sacreBLEU.

The corpus is a directory of ``{split}.{lang}`` files (default ``$AIAYN_DATA_DIR/multi30k``) or your own
parallel text (``aiayn.finetune.parallel``); ``init_from`` fine-tunes a translation model. The BPE, learned
on the training split, is one joint vocabulary or (``vocabulary="separate"``) a source and a target one.
Validation reports loss and greedy BLEU, the test split beam search BLEU and chrF."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import ConfigError, ModelConfig
from aiayn.data import data_dir, fetch_hint
from aiayn.data.parallel import (
    DataError,
    MissingDataError,
    pad_batch,
    read_parallel,
    split_paths,
    token_batches,
)
from aiayn.finetune.parallel import own_corpus
from aiayn.finetune.source import Source
from aiayn.tasks.base import register
from aiayn.tasks.sources import load_source, load_starting_point, needs_source
from aiayn.tasks.trained import resolve_model
from aiayn.tokenizers import (
    BPE_SPECIALS,
    SOURCE_TOKENIZER_FILE,
    TARGET_TOKENIZER_FILE,
    TOKENIZER_FILE,
    BPETokenizer,
)
from aiayn.train.losses import IGNORE, LossInput
from aiayn.train.run_dir import RunDirError, read_run_config
from aiayn.train.task import AttentionExample, Batch, Task, encoder_decoder_example
from aiayn.translate import DecodeOptions, Translator

VOCABULARIES = ("joint", "separate")


def tokenizer_files(vocabulary: str) -> tuple[str, str]:
    if vocabulary == "joint":
        return TOKENIZER_FILE, TOKENIZER_FILE
    return SOURCE_TOKENIZER_FILE, TARGET_TOKENIZER_FILE


def corpus_score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """sacreBLEU BLEU and chrF against one reference each, and lower-cased BLEU (``bleu_lc``)."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, bleu_lc, chrf = BLEU(), BLEU(lowercase=True), CHRF()
    bleu_score, lc_score, chrf_score = (metric.corpus_score(hypotheses, [references])
                                        for metric in (bleu, bleu_lc, chrf))
    return {"bleu": bleu_score.score, "chrf": chrf_score.score, "bleu_lc": lc_score.score,
            "bleu_text": str(bleu_score), "bleu_signature": str(bleu.get_signature()),
            "bleu_lc_signature": str(bleu_lc.get_signature()), "chrf_signature": str(chrf.get_signature())}


@register
class TranslationTask(Task):
    name = "translation"
    attention_kinds = ("cross", "encoder", "decoder")
    description = "machine translation on parallel text (default Multi30k en->de), BPE, beam search, sacreBLEU"

    def __init__(self, *, src_lang: str | None = None, tgt_lang: str | None = None, corpus: str = "multi30k",
                 corpus_dir: str | None = None, vocab_size: int = 8000, max_tokens: int = 4096,
                 max_len: int = 128, train_split: str = "train", val_split: str = "val",
                 test_split: str = "test2016", val_bleu: bool = True, beam_size: int = 5,
                 length_penalty: float = 0.6, vocabulary: str = "joint", tgt_vocab_size: int | None = None,
                 src: str | None = None, tgt: str | None = None, data: str | list[str] | None = None,
                 init_from: str | None = None, **options: Any) -> None:
        # A language not given: the starting model's, else English -> German (Multi30k's default pair).
        if init_from is not None and (src_lang is None or tgt_lang is None):
            start_src, start_tgt = starting_languages(init_from)
            src_lang, tgt_lang = src_lang or start_src, tgt_lang or start_tgt
        src_lang, tgt_lang = src_lang or "en", tgt_lang or "de"
        # A joint run records no vocabulary options, a Multi30k run no options of your own data.
        separate_options = ({} if vocabulary == "joint" and tgt_vocab_size is None
                            else dict(vocabulary=vocabulary, tgt_vocab_size=tgt_vocab_size))
        own = {k: v for k, v in dict(src=src, tgt=tgt, data=data, init_from=init_from).items() if v is not None}
        super().__init__(src_lang=src_lang, tgt_lang=tgt_lang, corpus=corpus, corpus_dir=corpus_dir,
                         vocab_size=vocab_size, max_tokens=max_tokens, max_len=max_len,
                         train_split=train_split, val_split=val_split, test_split=test_split,
                         val_bleu=val_bleu, beam_size=beam_size, length_penalty=length_penalty,
                         **separate_options, **own, **options)
        if src_lang == tgt_lang:
            raise DataError(f"source and target language are both {src_lang!r}")
        for lang in (src_lang, tgt_lang):  # a file suffix and part of names: no paths, no spaces
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,15}", lang):
                raise ConfigError(f"language {lang!r}: give a code of letters, digits, '-' or '_' (en, pt-BR)")
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.corpus_dir = corpus_dir
        self.src, self.tgt, self.init_from = src, tgt, init_from
        self.data = one_folder(data)
        self.source: Source | None = None  # the starting point, loaded once (``starting_point``)
        self.echo = print  # where the task states how it made the validation set
        self.vocabulary = check_vocabulary(vocabulary, vocab_size, tgt_vocab_size)
        # vocab_size: the joint or the source BPE's size; tgt_vocab_size: the target's (None when joint).
        self.tgt_vocab_size = None if vocabulary == "joint" else (tgt_vocab_size or vocab_size)
        self.vocab_size, self.max_tokens, self.max_len = vocab_size, max_tokens, max_len
        self.split_names = {"train": train_split, "val": val_split, "test": test_split}
        self.test_split = "test"
        self.val_bleu = val_bleu
        self.decode = DecodeOptions(beam_size=beam_size, length_penalty=length_penalty)
        # The source and target tokenizers: one object twice for a joint vocabulary.
        self.tokenizers: tuple[BPETokenizer, BPETokenizer] | None = None
        self.ids: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
        self.text: dict[str, tuple[list[str], list[str]]] = {}

    def starting_point(self) -> Source:
        """The model ``init_from`` names, loaded once, checked against this task's options."""
        if self.source is None:
            self.source = translation_source(self.init_from)
            check_starting_task(self, self.source.run.task)
        return self.source

    def model_config(self) -> ModelConfig:
        """``recipes/multi30k-en-de.yaml``'s (Transformer-tiny, Wu et al. 2021), or the starting point's."""
        if self.init_from is not None:
            return self.starting_point().config
        return ModelConfig(
            arch="encoder-decoder", vocab_size=self.vocab_size, tgt_vocab_size=self.tgt_vocab_size, d_model=128,
            n_heads=4, n_layers=4, n_decoder_layers=4, d_ff=256, activation="relu", norm_position="post",
            positional="sinusoidal", dropout=0.3, attention_dropout=0.1, activation_dropout=0.1,
            max_seq_len=self.max_len, share_embeddings=not self.separate, tie_output=True, pad_id=0,
            name=f"{self.src_lang}-{self.tgt_lang}")

    @property
    def separate(self) -> bool:
        return self.vocabulary == "separate"

    def check_model_config(self, config: ModelConfig) -> None:
        """A one-line ``ConfigError`` for a model that cannot take this task's vocabularies."""
        if not self.separate:
            return
        if config.share_embeddings:
            raise ConfigError("vocabulary: separate gives the source and the target a BPE each, but the model "
                              "has share_embeddings=True (one embedding for both); set share_embeddings: false, "
                              "or vocabulary: joint")
        for field, side, size in (("vocab_size", "source", self.vocab_size),
                                  ("tgt_vocab_size", "target", self.tgt_vocab_size)):
            if getattr(config, field) < size:  # the BPE's ids would index past the embedding
                raise ConfigError(f"the model's {field} is {getattr(config, field)} but the task's {side} BPE "
                                  f"has up to {size} tokens; leave the model's {field} to the task (its "
                                  f"{field} option)")

    def build_model(self, config: ModelConfig) -> nn.Module:
        """The starting point's model where the run needs its weights (``needs_source``), else ``config``'s."""
        if self.init_from is None:
            self.check_model_config(config)
        elif needs_source(self.run_dir):
            return load_starting_point(self.starting_point, self.init_from, self.run_dir).model
        return super().build_model(config)

    def train_overrides(self) -> dict[str, Any]:
        """``recipes/multi30k-en-de.yaml``'s: peak 3e-3 after 600 warmup steps, then cosine (the Noam
        schedule's peak would be far too small here)."""
        recipe = dict(epochs=80, lr=3e-3, schedule="cosine", warmup_steps=600, optimizer="adam",
                      label_smoothing=0.1, clip_grad_norm=1.0, keep_checkpoints=5, average_last=5)
        # A fine-tune moves a trained model a little: fewer epochs at a tenth of the learning rate.
        return recipe if self.init_from is None else {**recipe, "epochs": 10, "lr": 3e-4, "warmup_steps": 100}

    def root(self) -> Path:
        return Path(self.corpus_dir) if self.corpus_dir else data_dir() / self.options["corpus"]

    @property
    def tokenizer(self) -> BPETokenizer | None:
        """The source (or joint) tokenizer, None before loading; its special ids are the target's."""
        return self.tokenizers[0] if self.tokenizers is not None else None

    def load_tokenizers(self) -> tuple[BPETokenizer, BPETokenizer]:
        """(source, target) tokenizers of the run (needs ``run_dir``)."""
        if self.tokenizers is None:
            names = tokenizer_files(self.vocabulary)
            missing = [name for name in dict.fromkeys(names)
                       if self.run_dir is None or not (self.run_dir / name).is_file()]
            if missing:
                raise DataError(f"no {' nor '.join(missing)} in run directory {self.run_dir}; "
                                f"is it a translation run?")
            assert self.run_dir is not None
            source = BPETokenizer.load(self.run_dir / names[0])
            self.tokenizers = source, source if names[1] == names[0] else BPETokenizer.load(self.run_dir / names[1])
        return self.tokenizers

    def _learn_tokenizers(self) -> tuple[BPETokenizer, BPETokenizer]:
        """The run's saved tokenizers, else learned on the training split (and saved in the run)."""
        names = tokenizer_files(self.vocabulary)
        if self.run_dir is not None and all((self.run_dir / name).is_file() for name in names):
            return self.load_tokenizers()
        src, tgt = self.text["train"]
        if self.init_from is not None:  # the starting point's
            pair = self.starting_point().run.task.load_tokenizers()
        elif self.separate:  # each side its own merges, learned on that side of train only
            pair = (BPETokenizer.train(src, vocab_size=self.vocab_size),
                    BPETokenizer.train(tgt, vocab_size=self.tgt_vocab_size))
        else:  # one joint vocabulary: shared embeddings need it
            joint = BPETokenizer.train([*src, *tgt], vocab_size=self.vocab_size)
            pair = (joint, joint)
        if self.run_dir is not None:
            for name, tokenizer in dict(zip(names, pair, strict=True)).items():
                tokenizer.save(self.run_dir / name)
        return pair

    def prepare(self, seed: int) -> None:
        self.text = self.read_text(seed)
        self.tokenizers = source, target = self._learn_tokenizers()
        if self.init_from is None:
            self._check_bpe_sizes(source, target)
        eos = source.eos_id
        for split, (src, tgt) in self.text.items():
            src_ids, tgt_ids = source.encode_batch(src), target.encode_batch(tgt)
            # + </s>; pairs longer than the model's maximum are cut (training) — rare by design.
            cut = self.max_len - 1
            self.ids[split] = ([[*s[:cut], eos] for s in src_ids], [[*t[:cut], eos] for t in tgt_ids])

    def read_text(self, seed: int) -> dict[str, tuple[list[str], list[str]]]:
        """{split: (sources, targets)} of the corpus folder or your own data (without a test split)."""
        if self.src is None and self.tgt is None and self.data is None:
            text = {}
            for split, name in self.split_names.items():
                paths = split_paths(self.root(), name, self.src_lang, self.tgt_lang)
                for path in paths:
                    if not path.is_file():  # naming the command that fetches it (default root only)
                        hint = ("give the task option corpus_dir the folder that holds it" if self.corpus_dir
                                else fetch_hint(self.options["corpus"]))
                        raise MissingDataError(f"{path} not found; {hint}")
                text[split] = read_parallel(*paths)
            return text
        text = own_corpus(self.src, self.tgt, self.data, (self.src_lang, self.tgt_lang), self.split_names,
                          seed=seed, echo=self.echo)
        self.test_split = "test" if "test" in text else "val"
        return text

    def _check_bpe_sizes(self, source: BPETokenizer, target: BPETokenizer) -> None:
        """A ``DataError`` naming the option when a learned BPE has more tokens (its alphabet) than asked."""
        sides = ((("source", source, "vocab_size", self.vocab_size),
                  ("target", target, "tgt_vocab_size", self.tgt_vocab_size)) if self.separate
                 else (("joint", source, "vocab_size", self.vocab_size),))
        for side, tokenizer, option, size in sides:
            if tokenizer.vocab_size > size:
                raise DataError(f"the {side} BPE has {tokenizer.vocab_size} tokens (its alphabet and "
                                f"special tokens) but {option} is {size}; raise {option}")

    def split_size(self, split: str) -> int:
        return len(self.ids[split][0])

    def lengths(self, split: str) -> tuple[Tensor, Tensor]:
        src, tgt = self.ids[split]
        return torch.tensor([len(s) for s in src]), torch.tensor([len(t) for t in tgt])

    def train_batches(self, epoch: int, batch_size: int, seed: int) -> list[Tensor]:
        """Length-bucketed batches of up to ``max_tokens`` padded tokens (``batch_size`` is unused)."""
        return token_batches(*self.lengths("train"), self.max_tokens, seed=seed, epoch=epoch)

    def memory_batches(self, batches: list[Tensor]) -> list[Tensor]:
        """The batch of the most pairs and the one of the longest pair."""
        if not batches:
            return []
        longest_side = torch.maximum(*self.lengths("train"))  # (pairs,)
        longest = max(batches, key=lambda indices: int(longest_side[indices].max()))
        return [max(batches, key=len), longest]

    def eval_batches(self, split: str, batch_size: int) -> list[Batch]:
        return [self.collate(split, b) for b in token_batches(*self.lengths(split), self.max_tokens, seed=None)]

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

    def forward(self, model: nn.Module, batch: Batch) -> tuple[LossInput, Tensor]:
        targets = batch["tgt_out"].masked_fill(batch["tgt_out"] == self.tokenizer.pad_id, IGNORE)
        # The model's output, not its logits: the loss applies the output layer.
        return model(batch["src"], batch["tgt_in"]), targets

    def translator(self, model: nn.Module) -> Translator:
        """A ``Translator`` of ``model`` that searches as this run's test split is scored."""
        source, target = self.load_tokenizers()
        return Translator(model, source, target_tokenizer=target, max_tokens=self.max_tokens, options=self.decode)

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
        sources, references = self.text[self.test_split]
        hypotheses = self.translator(model).translate(sources[:n], self.decode)
        return [f"{s}  ->  {h}  (reference: {r})"
                for s, h, r in zip(sources[:n], hypotheses, references[:n], strict=True)]

    def attention_maps(self, model: nn.Module, text: str | None, kind: str) -> AttentionExample:
        """The maps of one sentence (``text``, or the first test source) and its greedy translation."""
        source_tok, target_tok = self.load_tokenizers()
        source = text if text is not None else self.text[self.test_split][0][0]
        translator = self.translator(model)
        src_ids = translator.source_ids(source)
        tgt_ids = translator.translate_ids([src_ids], DecodeOptions(beam_size=1))[0]
        src = pad_batch([src_ids], source_tok.pad_id)
        tgt_in = pad_batch([[target_tok.bos_id, *tgt_ids]], target_tok.pad_id)
        on_model = self.on_model(model, {"src": src, "tgt_in": tgt_in})
        out = model(on_model["src"], on_model["tgt_in"], need_weights=True)
        source_label, target_label = source_tok.tokenizer.id_to_token, target_tok.tokenizer.id_to_token
        return encoder_decoder_example(out, kind, [source_label(i) for i in src_ids],
                                       [target_label(i) for i in [target_tok.bos_id, *tgt_ids]],
                                       f"{self.src_lang}->{self.tgt_lang}")


def check_vocabulary(vocabulary: str, vocab_size: int, tgt_vocab_size: int | None) -> str:
    """``vocabulary`` as given, or a ``ConfigError`` (one line) for options that contradict it."""
    if vocabulary not in VOCABULARIES:
        raise ConfigError(f"vocabulary must be one of {', '.join(VOCABULARIES)}, got {vocabulary!r}")
    for name, size in (("vocab_size", vocab_size), ("tgt_vocab_size", tgt_vocab_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= len(BPE_SPECIALS)):
            raise ConfigError(f"{name} must be an integer above {len(BPE_SPECIALS)} (the special tokens), "
                              f"got {size!r}")
    if vocabulary == "joint" and tgt_vocab_size is not None:
        raise ConfigError(f"tgt_vocab_size={tgt_vocab_size} sizes the target BPE of vocabulary: separate; a joint "
                          f"vocabulary has one size, vocab_size (set vocabulary: separate, or drop tgt_vocab_size)")
    return vocabulary


def one_folder(data: str | list[str] | None) -> str | None:
    """The ``data`` option of translation: one folder (given once; a list of one is what --data makes)."""
    folders = [data] if isinstance(data, str) else list(data or [])
    if len(folders) > 1:
        raise ConfigError(f"translation reads one data folder, got {len(folders)} ({', '.join(folders)}); give "
                          f"one folder of train/val/test files")
    return folders[0] if folders else None


def check_starting_task(task: TranslationTask, start: TranslationTask) -> None:
    """A ``ConfigError`` where the starting model's languages or vocabulary differ from ``task``'s options."""
    if (start.src_lang, start.tgt_lang) != (task.src_lang, task.tgt_lang):
        raise ConfigError(f"{task.init_from} translates {start.src_lang}->{start.tgt_lang} but the task's languages "
                          f"are {task.src_lang}->{task.tgt_lang}; leave the languages out (--src-lang, --tgt-lang; "
                          f"a recipe's src_lang, tgt_lang) to take {start.src_lang}->{start.tgt_lang} from it")
    if start.vocabulary != task.vocabulary:
        raise ConfigError(f"{task.init_from} has a {start.vocabulary} vocabulary; give vocabulary: {start.vocabulary}")


def starting_languages(init_from: str) -> tuple[str | None, str | None]:
    """(source, target) languages of the translation model ``init_from`` names, read from its config.json
    without loading it; (None, None) where there is none to read (loading it later says why)."""
    try:
        options = read_run_config(resolve_model(init_from)).get("task_options", {})
    except RunDirError:
        return None, None
    return options.get("src_lang"), options.get("tgt_lang")


def translation_source(init_from: str) -> Source:
    """A shipped translation model or run as a starting point (its tokenizers through ``run.task``)."""
    source = load_source(init_from)
    if source.run is None or source.run.task.name != "translation":
        what = source.kind if source.run is None else f"{source.run.task.name} model"
        raise ConfigError(f"{init_from} is a {what}; the translation task starts from a translation model "
                          f"(aiayn models lists the shipped ones)")
    return source
