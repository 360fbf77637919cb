"""aiayn: Attention Is All You Need, complete. The Transformer of Vaswani et al. (2017) and its
descendants (GPT, BERT, LLaMA) from one attention module and one residual block."""

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

# aiayn/api.py, imported on first use so that ``import aiayn`` stays light.
_API = ("load", "generate_text", "train_run")


def __getattr__(name: str):
    if name in _API:
        from aiayn import api

        return getattr(api, name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")

__all__ = ["ConfigError", "DecoderOnly", "EncoderDecoder", "EncoderOnly", "ModelConfig", "__version__",
           "build_model", "count_parameters", "generate_text", "get_preset", "load", "train_run"]
