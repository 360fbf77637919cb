"""aiayn: Attention Is All You Need, complete.

The Transformer of Vaswani et al. (2017) and its descendants (GPT, BERT, LLaMA) from one attention
module and one residual block, proved equal to reference implementations.
"""

from aiayn.config import ConfigError, ModelConfig
from aiayn.models import (
    DecoderOnly,
    EncoderDecoder,
    EncoderOnly,
    build_model,
    count_parameters,
    get_preset,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DecoderOnly",
    "EncoderDecoder",
    "EncoderOnly",
    "ModelConfig",
    "__version__",
    "build_model",
    "count_parameters",
    "get_preset",
]
