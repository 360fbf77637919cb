"""Converters between aiayn models and other checkpoint formats (Hugging Face, GGUF).

Hugging Face needs only ``safetensors``; GGUF needs ``pip install -e '.[gguf]'``. ``nn`` and ``models`` never
import this package."""

from aiayn.interop.gguf import GGUFError, load_gguf
from aiayn.interop.hf import export_hf, from_hf_model, from_hf_state, load_hf, read_hf_checkpoint
from aiayn.interop.mapping import InteropError

__all__ = ["GGUFError", "InteropError", "export_hf", "from_hf_model", "from_hf_state", "load_gguf",
           "load_hf", "read_hf_checkpoint"]
