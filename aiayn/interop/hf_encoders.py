"""Hugging Face families with an encoder: BERT, BART and Marian."""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.interop.hf_families import (
    Family,
    HFConfig,
    build_config,
    check_export,
    hf_activation,
    hf_pad_id,
)
from aiayn.interop.mapping import (
    InteropError,
    Rule,
    copy_rule,
    fused_linear_rules,
    linear_rules,
    norm_rules,
    sublayer_rules,
)
from aiayn.nn.positional import sinusoidal_encoding


class BertFamily(Family):
    """BERT: post-norm, learned positions and token types. The pooler and MLM head are optional; the
    next-sentence head is dropped with a warning. Export writes BertForMaskedLM."""

    name = "bert"
    model_types = ("bert",)
    architectures = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
    ignore = (r"embeddings\.(position_ids|token_type_ids)",)  # index buffers, not weights

    def normalize(self, name: str) -> str:
        name = name.removeprefix("bert.")
        return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))

    def to_config(self, hf: HFConfig) -> ModelConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise InteropError(f"{hf.source}: position_embedding_type="
                               f"{hf.get('position_embedding_type')!r} is not supported (only 'absolute')")
        if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
            raise InteropError(f"{hf.source}: BERT as a decoder (is_decoder / add_cross_attention) is not supported")
        vocab = hf.need("vocab_size")
        return build_config(hf, arch="encoder-only", name="hf-bert", vocab_size=vocab, d_model=hf.need("hidden_size"),
                            n_heads=hf.need("num_attention_heads"), n_layers=hf.need("num_hidden_layers"),
                            d_ff=hf.need("intermediate_size"), activation=hf_activation(hf, "hidden_act", "gelu"),
                            norm="layernorm", norm_eps=float(hf.get("layer_norm_eps", 1e-12)), norm_position="post",
                            final_norm=False, positional="learned", max_seq_len=hf.get("max_position_embeddings", 512),
                            type_vocab_size=hf.get("type_vocab_size", 2), embedding_norm=True,
                            dropout=float(hf.get("hidden_dropout_prob", 0.0)),
                            attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
                            bias=True, scale_embeddings=False, tie_output=bool(hf.get("tie_word_embeddings", True)),
                            pad_id=hf_pad_id(hf, vocab))

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        d = cfg.d_model
        rules = [copy_rule("encoder.embedding.weight", "embeddings.word_embeddings.weight"),
                 copy_rule("encoder.absolute.weight", "embeddings.position_embeddings.weight")]
        if cfg.type_vocab_size > 0:
            rules.append(copy_rule("encoder.segment_embedding.weight", "embeddings.token_type_embeddings.weight"))
        rules += norm_rules("encoder.embedding_norm", "embeddings.LayerNorm", bias=True)
        for i in range(cfg.n_layers):
            ours, theirs = f"encoder.blocks.{i}", f"encoder.layer.{i}"
            s, o = f"{theirs}.attention.self", f"{theirs}.attention.output"
            rules += sublayer_rules(f"{ours}.self_attn", [f"{s}.query", f"{s}.key", f"{s}.value"],
                                    f"{o}.dense", f"{o}.LayerNorm", sizes=[d, d, d])
            rules += sublayer_rules(f"{ours}.ffn", f"{theirs}.intermediate.dense",
                                    f"{theirs}.output.dense", f"{theirs}.output.LayerNorm")
        rules += linear_rules("pooler", "pooler.dense", bias=True, group="the pooler (pooler.dense)")
        mlm = "the MLM head (cls.predictions)"
        rules += linear_rules("mlm_dense", "cls.predictions.transform.dense", bias=True, group=mlm)
        rules += norm_rules("mlm_norm", "cls.predictions.transform.LayerNorm", bias=True, group=mlm)
        rules.append(copy_rule("mlm_head.bias", "cls.predictions.bias", group=mlm))
        if not cfg.tie_output:
            rules.append(copy_rule("mlm_head.weight", "cls.predictions.decoder.weight", group=mlm))
        return rules

    def aliases(self, cfg: ModelConfig) -> dict[str, str]:
        out = {"cls.predictions.decoder.bias": "cls.predictions.bias"}
        if cfg.tie_output:
            out["cls.predictions.decoder.weight"] = "embeddings.word_embeddings.weight"
        return out

    def prepare(self, tensors: dict[str, Tensor], config: ModelConfig, source: str) -> None:
        nsp = [k for k in tensors if k.startswith("cls.seq_relationship.")]
        if nsp:
            for k in nsp:
                del tensors[k]
            warnings.warn(f"{source}: dropped the next-sentence head ({', '.join(sorted(nsp))}); "
                          f"aiayn's EncoderOnly has no module for it", stacklevel=4)

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        check_export(cfg, "BERT", arch="encoder-only", positional="learned", position_offset=0,
                      norm="layernorm", norm_position="post", final_norm=False,
                      activation=("gelu", "gelu_tanh", "relu", "silu"), embedding_norm=True,
                      scale_embeddings=False, attn_bias=True, attn_out_bias=True, mlp_bias=True,
                      n_kv_heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads)
        act = {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation)
        return {
            "architectures": ["BertForMaskedLM"], "model_type": "bert",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
            "intermediate_size": cfg.d_ff, "hidden_act": act,
            "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.type_vocab_size,
            "layer_norm_eps": cfg.norm_eps, "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.attention_dropout,
            "pad_token_id": cfg.pad_id, "tie_word_embeddings": cfg.tie_output,
        }

    def export_name(self, name: str) -> str:
        return name if name.startswith("cls.") else f"bert.{name}"


class BartFamily(Family):
    """BART: post-norm with ``layernorm_embedding``, positions offset by 2, ``model.shared`` tied everywhere
    unless ``tie_word_embeddings=False``, ``final_logits_bias`` -> ``lm_head.bias``."""

    name = "bart"
    model_types = ("bart",)
    architectures = ("BartForConditionalGeneration", "BartModel")

    def _common(self, hf: HFConfig) -> dict[str, Any]:
        heads = hf.need("encoder_attention_heads")
        ffn = hf.need("encoder_ffn_dim")
        if hf.get("decoder_attention_heads", heads) != heads or hf.get("decoder_ffn_dim", ffn) != ffn:
            raise InteropError(f"{hf.source}: encoder and decoder differ in attention heads or FFN width "
                               f"({heads}/{hf.get('decoder_attention_heads')}, {ffn}/{hf.get('decoder_ffn_dim')}); "
                               f"aiayn's EncoderDecoder uses one n_heads and one d_ff")
        if hf.get("normalize_before", False) or hf.get("add_final_layer_norm", False):
            raise InteropError(f"{hf.source}: pre-norm variants (normalize_before / add_final_layer_norm, "
                               f"mBART-style) are not supported by the {self.name} converter")
        return dict(
            arch="encoder-decoder", name=f"hf-{self.name}", d_model=hf.need("d_model"), n_heads=heads,
            n_layers=hf.need("encoder_layers"), n_decoder_layers=hf.get("decoder_layers", hf.need("encoder_layers")),
            d_ff=ffn, activation=hf_activation(hf, "activation_function", "gelu"), norm="layernorm",
            norm_eps=1e-5, norm_position="post", final_norm=False,
            max_seq_len=hf.get("max_position_embeddings", 1024),
            dropout=float(hf.get("dropout", 0.0)), attention_dropout=float(hf.get("attention_dropout", 0.0)),
            activation_dropout=float(hf.get("activation_dropout", 0.0)),
            bias=True, lm_head_bias=True, scale_embeddings=bool(hf.get("scale_embedding", False)),
            tie_output=bool(hf.get("tie_word_embeddings", True)),
        )

    def to_config(self, hf: HFConfig) -> ModelConfig:
        vocab = hf.need("vocab_size")
        tied = bool(hf.get("tie_word_embeddings", True))
        return build_config(hf, **self._common(hf), vocab_size=vocab, share_embeddings=tied,
                             positional="learned", position_offset=2, embedding_norm=True,
                             pad_id=hf_pad_id(hf, vocab))

    def _position_rules(self, cfg: ModelConfig) -> list[Rule]:
        rules = []
        for stack in ("encoder", "decoder"):
            rules.append(copy_rule(f"{stack}.absolute.weight", f"model.{stack}.embed_positions.weight"))
            rules += norm_rules(f"{stack}.embedding_norm", f"model.{stack}.layernorm_embedding", bias=True)
        return rules

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        d = cfg.d_model
        if cfg.share_embeddings:
            rules = [copy_rule("encoder.embedding.weight", "model.shared.weight")]
        else:
            rules = [copy_rule("encoder.embedding.weight", "model.encoder.embed_tokens.weight"),
                     copy_rule("decoder.embedding.weight", "model.decoder.embed_tokens.weight")]
        rules += self._position_rules(cfg)
        for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
            for i in range(n):
                ours, theirs = f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}"
                a = f"{theirs}.self_attn"
                rules += sublayer_rules(f"{ours}.self_attn", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                                        f"{a}.out_proj", f"{theirs}.self_attn_layer_norm", sizes=[d, d, d])
                if stack == "decoder":
                    c = f"{theirs}.encoder_attn"
                    rules += linear_rules(f"{ours}.cross_attn.q_proj", f"{c}.q_proj", bias=True)
                    rules += fused_linear_rules(f"{ours}.cross_attn.kv_proj",
                                                [f"{c}.k_proj", f"{c}.v_proj"], [d, d], bias=True)
                    rules += linear_rules(f"{ours}.cross_attn.out_proj", f"{c}.out_proj", bias=True)
                    rules += norm_rules(f"{ours}.cross_attn_norm", f"{theirs}.encoder_attn_layer_norm", bias=True)
                rules += sublayer_rules(f"{ours}.ffn", f"{theirs}.fc1", f"{theirs}.fc2",
                                        f"{theirs}.final_layer_norm")
        # (1, v) in the checkpoint; prepare() makes it (v,). BartModel has no LM head at all.
        rules.append(copy_rule("lm_head.bias", "final_logits_bias", group="the logits bias (final_logits_bias)"))
        return rules + self.head_rules(cfg)

    def normalize(self, name: str) -> str:
        # BartModel / MarianModel store the body without the "model." prefix.
        keep = ("model.", "lm_head.", "final_logits_bias")
        return name if name.startswith(keep) else f"model.{name}"

    def aliases(self, cfg: ModelConfig) -> dict[str, str]:
        if not cfg.share_embeddings:
            return {"lm_head.weight": "model.decoder.embed_tokens.weight"} if cfg.tie_output else {}
        shared = "model.shared.weight"
        out = {"model.encoder.embed_tokens.weight": shared, "model.decoder.embed_tokens.weight": shared}
        if cfg.tie_output:
            out["lm_head.weight"] = shared
        return out

    def prepare(self, tensors: dict[str, Tensor], config: ModelConfig, source: str) -> None:
        # final_logits_bias is a (1, v) buffer; aiayn's lm_head.bias is (v,).
        bias = tensors.get("final_logits_bias")
        if bias is not None and bias.dim() == 2 and bias.shape[0] == 1:
            tensors["final_logits_bias"] = bias[0]
        # Untied stacks: model.shared is transformers 4's copy of both, and unread in transformers 5.
        shared = None if config.share_embeddings else tensors.pop("model.shared.weight", None)
        if shared is not None:
            for stack in ("encoder", "decoder"):
                tensors.setdefault(f"model.{stack}.embed_tokens.weight", shared)

    def finish_export(self, tensors: dict[str, Tensor], config: ModelConfig) -> None:
        tensors["final_logits_bias"] = tensors["final_logits_bias"][None]  # (v,) -> (1, v)
        if not config.share_embeddings and self.name == "bart":
            # BartModel always has model.shared; untied, the forward pass does not read it.
            tensors["model.shared.weight"] = tensors["model.encoder.embed_tokens.weight"].clone()

    def _export_common(self, cfg: ModelConfig, family: str, **expected: Any) -> dict[str, Any]:
        check_export(cfg, family, arch="encoder-decoder", norm="layernorm", norm_position="post",
                      final_norm=False, activation=("gelu", "gelu_tanh", "relu", "silu"),
                      attn_bias=True, attn_out_bias=True, mlp_bias=True, lm_head_bias=True,
                      n_kv_heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads, norm_eps=1e-5,
                      **expected)
        if cfg.share_embeddings and not cfg.tie_output:
            raise InteropError(f"a {family} checkpoint (transformers 5) unties the shared embedding "
                               f"when the output is untied: share_embeddings=True needs tie_output=True")
        act = {"gelu_tanh": "gelu_new", "silu": "swish"}.get(cfg.activation, cfg.activation)
        return {
            "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
            "encoder_layers": cfg.n_layers, "decoder_layers": cfg.n_decoder_layers,
            "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
            "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "activation_function": act,
            "max_position_embeddings": cfg.max_seq_len, "scale_embedding": cfg.scale_embeddings,
            "dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout,
            "activation_dropout": cfg.activation_dropout, "tie_word_embeddings": cfg.tie_output,
            "pad_token_id": cfg.pad_id, "is_encoder_decoder": True,
        }

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        out = self._export_common(cfg, "BART", positional="learned", position_offset=2,
                                  embedding_norm=True, tgt_vocab_size=cfg.vocab_size,
                                  share_embeddings=cfg.tie_output)
        return {"architectures": ["BartForConditionalGeneration"], "model_type": "bart", **out,
                "decoder_start_token_id": 2, "bos_token_id": 0, "eos_token_id": 2,
                "forced_eos_token_id": None}


class MarianFamily(BartFamily):
    """Marian (OPUS-MT): BART's layout with split sinusoidal positions (checked, not loaded), no embedding
    LayerNorm, optionally a separate target vocabulary."""

    name = "marian"
    model_types = ("marian",)
    architectures = ("MarianMTModel", "MarianModel")

    def to_config(self, hf: HFConfig) -> ModelConfig:
        vocab = hf.need("vocab_size")
        shared = bool(hf.get("share_encoder_decoder_embeddings", True))
        tgt_vocab = None if shared else hf.get("decoder_vocab_size", vocab)
        tied = bool(hf.get("tie_word_embeddings", True))
        return build_config(hf, **self._common(hf), vocab_size=vocab, tgt_vocab_size=tgt_vocab,
                             share_embeddings=shared and tied, positional="sinusoidal",
                             sinusoidal_layout="split", embedding_norm=False,
                             pad_id=hf_pad_id(hf, vocab if tgt_vocab is None else min(vocab, tgt_vocab)))

    def _position_rules(self, cfg: ModelConfig) -> list[Rule]:
        return []  # fixed sinusoids: nothing to load (prepare() checks stored tables)

    def prepare(self, tensors: dict[str, Tensor], config: ModelConfig, source: str) -> None:
        super().prepare(tensors, config, source)
        for stack in ("encoder", "decoder"):
            name = f"model.{stack}.embed_positions.weight"
            table = tensors.pop(name, None)
            if table is None:
                continue
            expected = sinusoidal_encoding(torch.arange(table.shape[0]), table.shape[1], layout="split")
            if not torch.allclose(table.detach().float().cpu(), expected, atol=1e-5, rtol=0):
                raise InteropError(f"{source}: {name} is not Marian's sinusoidal table (sin | cos halves); "
                                   f"this converter only supports the fixed sinusoidal positions")

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        out = self._export_common(cfg, "Marian", positional="sinusoidal", sinusoidal_layout="split",
                                  embedding_norm=False)
        start = cfg.pad_id if cfg.pad_id is not None else 0
        return {"architectures": ["MarianMTModel"], "model_type": "marian", **out,
                "share_encoder_decoder_embeddings": cfg.share_embeddings,
                "decoder_vocab_size": cfg.tgt_vocab_size,
                "decoder_start_token_id": start, "eos_token_id": 0, "forced_eos_token_id": None}
