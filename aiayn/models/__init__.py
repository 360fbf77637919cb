"""Thin model compositions of ``aiayn.models.blocks``."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.models.base import ModelOutput, count_parameters
from aiayn.models.blocks import TransformerBlock, TransformerStack
from aiayn.models.decoder_only import DecoderOnly
from aiayn.models.encoder_decoder import Encoded, EncoderDecoder
from aiayn.models.encoder_only import EncoderOnly
from aiayn.models.presets import get_preset, preset_names
from aiayn.models.size import check_fits

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "encoder-decoder": EncoderDecoder,
    "decoder-only": DecoderOnly,
    "encoder-only": EncoderOnly,
}


def build_model(config: ModelConfig) -> nn.Module:
    """The model class for ``config.arch``, freshly initialised; too large a config is refused first."""
    if torch.get_default_device().type != "meta":
        check_fits(config)
    return MODEL_CLASSES[config.arch](config)


__all__ = [
    "DecoderOnly",
    "Encoded",
    "EncoderDecoder",
    "EncoderOnly",
    "ModelOutput",
    "TransformerBlock",
    "TransformerStack",
    "build_model",
    "count_parameters",
    "get_preset",
    "preset_names",
]
