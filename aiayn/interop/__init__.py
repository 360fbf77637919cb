"""Converters between aiayn models and other checkpoint formats (Hugging Face, GGUF).

Hugging Face loading and exporting need only ``safetensors``; transformers is a test-time reference
(``pip install -e '.[hf]'`` for users who want it). GGUF needs ``pip install -e '.[gguf]'`` and
imports ``gguf`` only when a file is loaded. ``nn`` and ``models`` never import this package.
"""

from aiayn.interop.gguf import GGUFError, load_gguf
from aiayn.interop.hf import export_hf, from_hf_model, from_hf_state, load_hf, read_hf_checkpoint
from aiayn.interop.mapping import InteropError

__all__ = ["GGUFError", "InteropError", "export_hf", "from_hf_model", "from_hf_state", "load_gguf",
           "load_hf", "read_hf_checkpoint"]
