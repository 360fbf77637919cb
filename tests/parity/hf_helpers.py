"""Shared by the Hugging Face parity tests: seeded weights, padded batches, quiet transformers.

Tiny random models are built from configs (nothing is downloaded), saved with
``save_pretrained`` and read back with ``aiayn.interop.load_hf``, the converter users run; then both
are moved to the test's device (tests/conftest.py), where the checks below make their inputs.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from aiayn.device import model_device
from aiayn.generate import greedy_decoder_only
from aiayn.interop import export_hf, load_hf

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

VOCAB = 99


def randomize_hf_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Seeded weights large enough that every tensor matters (a 0.02 init hides transposes).

    Projections N(0, 1/fan_in) (``Conv1D`` stores (in, out)), embeddings N(0, 0.25), norm scales
    1 + N(0, 0.01), biases N(0, 0.01); frozen tables (Marian's sinusoids) are left alone.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(p: torch.Tensor) -> torch.Tensor:
        return torch.randn(p.shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owner = model.get_submodule(name.rpartition(".")[0])
            if p.dim() == 2 and isinstance(owner, nn.Embedding):
                p.copy_(0.5 * randn(p))
            elif p.dim() == 2:
                fan_in = p.shape[0] if type(owner).__name__ == "Conv1D" else p.shape[1]
                p.copy_(randn(p) / math.sqrt(fan_in))
            elif name.endswith("weight"):  # a norm's scale
                p.copy_(1.0 + 0.1 * randn(p))
            else:
                p.copy_(0.1 * randn(p))
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(0.1 * randn(b))
    return model.eval()


def random_tokens(shape: tuple[int, int], seed: int, low: int = 3, *, device: torch.device) -> torch.Tensor:
    """Ids in [low, VOCAB): clear of the special ids the tiny configs use. Drawn on the CPU (the same
    ids on every device), returned on ``device``."""
    return torch.randint(low, VOCAB, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def lengths_mask(lengths: list[int], t: int, *, left: bool, device: torch.device) -> torch.Tensor:
    """(b, t) long attention mask with ``lengths`` real tokens per row, padded left or right."""
    mask = torch.zeros(len(lengths), t, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        if left:
            mask[row, t - n:] = 1
        else:
            mask[row, :n] = 1
    return mask


def hf_positions(mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's position ids for a left-padded batch: count real tokens, pads get 1."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def save(hf_model: nn.Module, path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model.save_pretrained(path)
    return str(path)


def converted_case(name: str, model_cls: type[nn.Module], hf_config, tmp_path_factory,
                   device: torch.device) -> tuple:
    """A tiny random HF model saved to disk and loaded back by ``load_hf`` (the users' path), both
    then moved to ``device``: (name, HF model, its directory, aiayn model, aiayn config)."""
    torch.manual_seed(0)
    hf = randomize_hf_(model_cls(hf_config), seed=1)
    path = save(hf, tmp_path_factory.mktemp(name))
    model, config = load_hf(path)
    return name, hf.to(device), path, model.to(device), config


# ---- checks shared by the decoder-only families (LLaMA-style, GPT-2) ----------------------------
@torch.no_grad()
def check_decoder_logits(hf: nn.Module, model: nn.Module) -> None:
    tokens = random_tokens((3, 13), seed=2, device=model_device(model))
    assert_close(model(tokens).logits, hf(tokens).logits)


@torch.no_grad()
def check_decoder_left_padding(hf: nn.Module, model: nn.Module) -> None:
    """Left-padded batch; Hugging Face gets position ids counted over real tokens, as aiayn does.
    Pad positions' own outputs are not compared (Hugging Face leaves them unmasked garbage)."""
    device = model_device(model)
    mask = lengths_mask([13, 9, 4], 13, left=True, device=device)
    tokens = random_tokens((3, 13), seed=3, device=device).masked_fill(mask == 0, 0)
    expected = hf(tokens, attention_mask=mask, position_ids=hf_positions(mask)).logits
    got = model(tokens, valid=mask.bool()).logits
    real = mask.bool()
    assert_close(got[real], expected[real])


def check_decoder_generation(hf: nn.Module, model: nn.Module, *, use_cache: bool) -> None:
    """20 greedy tokens from a left-padded batch: same tokens and same logits at every step."""
    device = model_device(model)
    mask = lengths_mask([9, 6, 3], 9, left=True, device=device)
    prompt = random_tokens((3, 9), seed=4, device=device).masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                               output_logits=True)
    got = greedy_decoder_only(model, prompt, max_new_tokens=20, prompt_valid=mask.bool(),
                              use_cache=use_cache)
    assert expected.sequences.shape == (3, 9 + 20)
    assert torch.equal(got.tokens, expected.sequences[:, 9:])
    # Every step's logits, not only their argmax: random models soon repeat one token.
    assert_close(got.logits, torch.stack(expected.logits, dim=1))


@torch.no_grad()
def check_decoder_export(hf: nn.Module, model: nn.Module, config, out_dir) -> str:
    """export_hf -> transformers loads it -> same logits as the original; load_hf gives the model
    back. Returns the exported model_type."""
    device = model_device(model)
    out = export_hf(model, config, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval().to(device)
    tokens = random_tokens((3, 13), seed=6, device=device)
    assert_close(reloaded(tokens).logits, hf(tokens).logits)
    again, config_again = load_hf(out)
    again = again.to(device)
    assert config_again.replace(name=config.name) == config
    assert_close(again(tokens).logits, model(tokens).logits, rtol=0, atol=0)
    return json.loads((out / "config.json").read_text())["model_type"]


def check_batched_generation(model: nn.Module) -> None:
    """Left-padded batched generation through the users' API (generate_decoder_only, greedy,
    and greedy_decoder_only) gives each row the tokens it gets alone, unpadded."""
    from aiayn.generate import SamplingConfig, generate_decoder_only

    device = model_device(model)
    lengths = [9, 2, 6, 4]
    mask = lengths_mask(lengths, 9, left=True, device=device)
    prompt = random_tokens((4, 9), seed=7, device=device).masked_fill(mask == 0, 0)
    greedy = SamplingConfig(temperature=0)
    batched = generate_decoder_only(model, prompt, max_new_tokens=15, sampling=greedy, prompt_valid=mask.bool())
    batched_greedy = greedy_decoder_only(model, prompt, max_new_tokens=15, prompt_valid=mask.bool())
    assert torch.equal(batched, batched_greedy.tokens)
    for row, n in enumerate(lengths):
        alone = prompt[row:row + 1, 9 - n:]
        one = generate_decoder_only(model, alone, max_new_tokens=15, sampling=greedy,
                                    prompt_valid=torch.ones_like(alone, dtype=torch.bool))
        assert torch.equal(batched[row], one[0]), (row, batched[row], one[0])
        one_greedy = greedy_decoder_only(model, alone, max_new_tokens=15,
                                         prompt_valid=torch.ones_like(alone, dtype=torch.bool))
        assert_close(batched_greedy.logits[row], one_greedy.logits[0])
