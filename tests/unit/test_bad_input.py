"""Bad input gets an error that names the argument, the expected and the received value."""

from __future__ import annotations

import pytest
import torch

from aiayn import build_model, get_preset
from aiayn.nn.attention import MultiHeadAttention, scaled_dot_product_attention


@pytest.fixture(scope="module")
def gpt():
    return build_model(get_preset("gpt-tiny")).eval()


@pytest.fixture(scope="module")
def encdec():
    return build_model(get_preset("tiny")).eval()


def test_token_ids_out_of_range(gpt):
    with pytest.raises(ValueError, match=r"tokens holds token id 99, outside the vocabulary \[0, 99\)"):
        gpt(torch.tensor([[1, 2, 99]]))
    with pytest.raises(ValueError, match=r"token id -1"):
        gpt(torch.tensor([[1, -1]]))


def test_tokens_wrong_rank_dtype_or_empty(gpt):
    with pytest.raises(ValueError, match=r"tokens must have shape \(batch, seq\), got shape \(5,\)"):
        gpt(torch.arange(5))
    with pytest.raises(TypeError, match=r"integer token ids, got dtype torch.float32"):
        gpt(torch.ones(1, 3))
    with pytest.raises(ValueError, match="empty"):
        gpt(torch.zeros(1, 0, dtype=torch.long))


def test_sequence_longer_than_max_position(gpt, encdec):
    with pytest.raises(ValueError, match=r"sequence too long: position 64 .* max_seq_len=64"):
        gpt(torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence too long"):
        encdec(torch.ones(1, 65, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


def test_valid_mask_wrong_shape_or_dtype(gpt):
    tokens = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(TypeError, match=r"valid must be a bool tensor .* got dtype torch.int64"):
        gpt(tokens, valid=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"valid must have the tokens' shape \(2, 4\), got \(2, 3\)"):
        gpt(tokens, valid=torch.ones(2, 3, dtype=torch.bool))


def test_encoder_decoder_batch_mismatch(encdec):
    with pytest.raises(ValueError, match="src and tgt batch sizes differ"):
        encdec(torch.ones(2, 4, dtype=torch.long), torch.ones(3, 4, dtype=torch.long))


def test_attention_kernel_shapes_and_masks():
    q, k = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions .* got shape \(6, 3, 8\)"):
        scaled_dot_product_attention(q[0], k, k)
    with pytest.raises(ValueError, match="q and k head_dim differ: q has 8, k has 4"):
        scaled_dot_product_attention(q, k[..., :4], k[..., :4])
    with pytest.raises(ValueError, match=r"q heads \(6\) must be a multiple of k/v heads \(4\)"):
        scaled_dot_product_attention(q, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))
    with pytest.raises(TypeError, match=r"mask must be a bool tensor .* got dtype torch.float32"):
        scaled_dot_product_attention(q, k, k, mask=torch.ones(2, 1, 1, 5))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 4\) does not broadcast .* \(2, 6, 3, 5\)"):
        scaled_dot_product_attention(q, k, k, mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bias must be a float tensor"):
        scaled_dot_product_attention(q, k, k, bias=torch.ones(1, 6, 3, 5, dtype=torch.long))


def test_attention_module_input_width():
    mha = MultiHeadAttention(48, 6)
    with pytest.raises(ValueError, match=r"x must be \(batch, seq, d_model=48\), got shape \(2, 3, 40\)"):
        mha(torch.randn(2, 3, 40))
    cross = MultiHeadAttention(48, 6, cross=True)
    with pytest.raises(ValueError, match="needs memory="):
        cross(torch.randn(2, 3, 48))


def test_model_class_arch_mismatch():
    from aiayn.models import DecoderOnly

    with pytest.raises(ValueError, match=r"DecoderOnly needs config.arch='decoder-only'"):
        DecoderOnly(get_preset("tiny"))
