"""Converters between aiayn models and Hugging Face / GGUF checkpoints (GGUF needs ``.[gguf]``); ``nn`` and
``models`` never import this package."""

from aiayn.interop.gguf import GGUFError, load_gguf
from aiayn.interop.hf import export_hf, from_hf_model, from_hf_state, load_hf, read_hf_checkpoint
from aiayn.interop.mapping import InteropError

__all__ = ["GGUFError", "InteropError", "export_hf", "from_hf_model", "from_hf_state", "load_gguf",
           "load_hf", "read_hf_checkpoint"]
