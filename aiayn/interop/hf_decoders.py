"""Hugging Face decoder-only families: LLaMA (Mistral, Qwen2) and GPT-2."""

from __future__ import annotations

from typing import Any

from aiayn.config import ModelConfig
from aiayn.interop.hf_families import Family, HFConfig, build_config, check_export, hf_activation
from aiayn.interop.mapping import InteropError, Rule, copy_rule, norm_rules, sublayer_rules


class LlamaFamily(Family):
    """LLaMA, Mistral, Qwen2: RMSNorm, half-split RoPE, SwiGLU (``fc_in`` rows [gate; up]), grouped-query
    attention; Qwen2 has q/k/v biases only. Sliding windows cap ``max_seq_len``; ``pad_id`` is None."""

    name = "llama"
    tied_head = "model.embed_tokens.weight"
    model_types = ("llama", "mistral", "qwen2")
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "LlamaModel", "MistralModel", "Qwen2Model")
    ignore = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

    def normalize(self, name: str) -> str:
        # LlamaModel (no LM head) stores the body without the "model." prefix.
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"

    def _rope_theta(self, hf: HFConfig) -> float:
        # transformers >= 5 writes rope_parameters; older config.json rope_theta + rope_scaling.
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise InteropError(f"{hf.source}: RoPE scaling {rope_type!r} is not supported; aiayn implements the "
                               f"default RoPE only (rope_type 'default')")
        return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))

    def to_config(self, hf: HFConfig) -> ModelConfig:
        kind = hf.need("model_type")  # family_for picked this family by it
        d, n_heads = hf.need("hidden_size"), hf.need("num_attention_heads")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise InteropError(f"{hf.source}: hidden_act={hf.get('hidden_act')!r} is not supported "
                               f"for {kind}; aiayn's LLaMA MLP is SwiGLU (silu)")
        if kind == "qwen2":
            qkv_bias, out_bias, mlp_bias = True, False, False
        elif kind == "mistral":
            qkv_bias = out_bias = mlp_bias = False
        else:
            qkv_bias = out_bias = bool(hf.get("attention_bias", False))
            mlp_bias = bool(hf.get("mlp_bias", False))
        max_len = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        if window is not None and (kind == "mistral" or hf.get("use_sliding_window", False)):
            max_len = min(max_len, window)  # full attention == sliding window up to the window
        return build_config(hf, arch="decoder-only", name=f"hf-{kind}",
                            vocab_size=hf.need("vocab_size"), d_model=d, n_heads=n_heads,
                            n_kv_heads=hf.get("num_key_value_heads", n_heads),
                            head_dim=hf.get("head_dim", d // n_heads), n_layers=hf.need("num_hidden_layers"),
                            d_ff=hf.need("intermediate_size"), activation="swiglu", norm="rmsnorm",
                            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), norm_position="pre", final_norm=True,
                            positional="rope", rope_base=self._rope_theta(hf), max_seq_len=max_len,
                            attention_dropout=float(hf.get("attention_dropout", 0.0)),
                            bias=False, attn_bias=qkv_bias, attn_out_bias=out_bias, mlp_bias=mlp_bias,
                            scale_embeddings=False, tie_output=bool(hf.get("tie_word_embeddings", False)),
                            pad_id=None)

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
        rules = [copy_rule("decoder.embedding.weight", "model.embed_tokens.weight")]
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"model.layers.{i}"
            a, m = f"{theirs}.self_attn", f"{theirs}.mlp"
            rules += sublayer_rules(f"{ours}.self_attn", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                                    f"{a}.o_proj", f"{theirs}.input_layernorm", sizes=[q, kv, kv],
                                    bias=cfg.attn_bias, second_bias=cfg.attn_out_bias, norm_bias=False)
            rules += sublayer_rules(f"{ours}.ffn", [f"{m}.gate_proj", f"{m}.up_proj"],
                                    f"{m}.down_proj", f"{theirs}.post_attention_layernorm", sizes=[f, f],
                                    bias=cfg.mlp_bias, norm_bias=False)
        rules += norm_rules("decoder.final_norm", "model.norm", bias=False)
        return rules + self.head_rules(cfg)

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        check_export(cfg, "LLaMA/Qwen2", arch="decoder-only", positional="rope", norm="rmsnorm",
                      norm_position="pre", activation="swiglu", scale_embeddings=False,
                      final_norm=True, lm_head_bias=False, embedding_norm=False)
        qwen2 = cfg.attn_bias and not cfg.attn_out_bias and not cfg.mlp_bias
        if not qwen2 and cfg.attn_bias != cfg.attn_out_bias:
            raise InteropError(f"a LLaMA checkpoint has biases on all of q, k, v, o or on none, and Qwen2 on q, k, "
                               f"v only (no MLP bias); this model has attn_bias={cfg.attn_bias}, "
                               f"attn_out_bias={cfg.attn_out_bias}, mlp_bias={cfg.mlp_bias}")
        out: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_output,
            "rope_theta": cfg.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "attention_dropout": cfg.attention_dropout, "pad_token_id": None,
            "bos_token_id": None, "eos_token_id": None,
        }
        if qwen2:
            if cfg.head_dim * cfg.n_heads != cfg.d_model:
                raise InteropError(f"Qwen2 needs head_dim = d_model / n_heads, got head_dim={cfg.head_dim}")
            out["use_sliding_window"] = False
        else:
            out.update(head_dim=cfg.head_dim, attention_bias=cfg.attn_bias, mlp_bias=cfg.mlp_bias)
        return out


class GPT2Family(Family):
    """GPT-2: learned positions, "gelu_new", output tied to ``wte``; ``Conv1D`` weights stored (in, out)."""

    name = "gpt2"
    tied_head = "transformer.wte.weight"
    model_types = ("gpt2",)
    architectures = ("GPT2LMHeadModel", "GPT2Model")
    ignore = (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",)

    def normalize(self, name: str) -> str:
        return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"

    def to_config(self, hf: HFConfig) -> ModelConfig:
        if hf.get("scale_attn_by_inverse_layer_idx", False) or not hf.get("scale_attn_weights", True):
            raise InteropError(f"{hf.source}: GPT-2 with scale_attn_by_inverse_layer_idx=True or "
                               f"scale_attn_weights=False is not supported (aiayn scales by 1/sqrt(d_h))")
        if hf.get("add_cross_attention", False):
            raise InteropError(f"{hf.source}: GPT-2 with add_cross_attention=True is not supported")
        d = hf.need("n_embd")
        return build_config(
            hf, arch="decoder-only", name="hf-gpt2", vocab_size=hf.need("vocab_size"), d_model=d,
            n_heads=hf.need("n_head"), n_layers=hf.need("n_layer"), d_ff=hf.get("n_inner", 4 * d),
            activation=hf_activation(hf, "activation_function", "gelu_new"), norm="layernorm",
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), norm_position="pre",
            final_norm=True, positional="learned", max_seq_len=hf.get("n_positions", 1024),
            dropout=float(hf.get("resid_pdrop", 0.0)), attention_dropout=float(hf.get("attn_pdrop", 0.0)),
            bias=True, scale_embeddings=False, tie_output=bool(hf.get("tie_word_embeddings", True)),
            pad_id=None,
        )

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        rules = [copy_rule("decoder.embedding.weight", "transformer.wte.weight"),
                 copy_rule("decoder.absolute.weight", "transformer.wpe.weight")]
        for i in range(cfg.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"transformer.h.{i}"
            # Conv1D weights are (in, out): transpose. c_attn's columns are [q | k | v] already.
            rules += sublayer_rules(f"{ours}.self_attn", f"{theirs}.attn.c_attn", f"{theirs}.attn.c_proj",
                                    f"{theirs}.ln_1", transpose=True)
            rules += sublayer_rules(f"{ours}.ffn", f"{theirs}.mlp.c_fc", f"{theirs}.mlp.c_proj",
                                    f"{theirs}.ln_2", transpose=True)
        rules += norm_rules("decoder.final_norm", "transformer.ln_f", bias=True)
        return rules + self.head_rules(cfg)

    def export_config(self, cfg: ModelConfig) -> dict[str, Any]:
        check_export(cfg, "GPT-2", arch="decoder-only", positional="learned", position_offset=0,
                      norm="layernorm", norm_position="pre", activation=("gelu", "gelu_tanh", "relu", "silu"),
                      scale_embeddings=False, final_norm=True, lm_head_bias=False,
                      embedding_norm=False, attn_bias=True, attn_out_bias=True, mlp_bias=True,
                      n_kv_heads=cfg.n_heads, head_dim=cfg.d_model // cfg.n_heads)
        act = {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation)
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_head": cfg.n_heads,
            "n_layer": cfg.n_layers, "n_inner": cfg.d_ff, "n_positions": cfg.max_seq_len,
            "activation_function": act, "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.attention_dropout,
            "tie_word_embeddings": cfg.tie_output, "bos_token_id": None, "eos_token_id": None,
        }
