"""llama.cpp as a peer, through the prebuilt CPU library of ``llama-cpp-cffi`` (its C API, without
its Python package, which pins transformers < 5), importable without torch so that a process can
measure llama.cpp's own memory (``rss_child``). ``LlamaCpp``: greedy decoding of one prompt or a
batch, and the negative log-likelihood of token windows.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence

LLAMA_CPP_INSTALL = "pip install cffi && pip install --no-deps llama-cpp-cffi"


def llama_cpp_cffi_library():
    """(lib, ffi) of llama.cpp's C API from the ``llama-cpp-cffi`` wheel, loaded directly (its Python
    package pins transformers < 5); None if absent."""
    import glob
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("llama")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = [f for d in spec.submodule_search_locations for f in glob.glob(os.path.join(d, "_llama_cpp_cpu*.so"))]
    if not found:
        return None
    loader = importlib.machinery.ExtensionFileLoader("_llama_cpp_cpu", found[0])
    spec_so = importlib.util.spec_from_loader("_llama_cpp_cpu", loader)
    try:
        module = importlib.util.module_from_spec(spec_so)
    except ImportError as exc:
        if "__cxa_call_terminate" not in str(exc):
            raise
        # The wheel (GCC 14) calls __cxa_call_terminate, which an older libstdc++ lacks: supply it.
        _load_cxa_call_terminate_shim()
        module = importlib.util.module_from_spec(spec_so)
    loader.exec_module(module)
    return module.lib, module.ffi


def require_library():
    """``llama_cpp_cffi_library()``; ModuleNotFoundError naming ``llama`` when absent (for ``load_peer``)."""
    loaded = llama_cpp_cffi_library()
    if loaded is None:
        raise ModuleNotFoundError(f"llama-cpp-cffi is not installed: {LLAMA_CPP_INSTALL}", name="llama")
    return loaded


def _load_cxa_call_terminate_shim() -> None:
    import ctypes
    import subprocess
    import tempfile

    build = tempfile.mkdtemp(prefix="aiayn-cxa-")
    source, library = os.path.join(build, "shim.cc"), os.path.join(build, "libcxa_call_terminate.so")
    with open(source, "w") as f:
        f.write('#include <exception>\nextern "C" [[noreturn]] void __cxa_call_terminate(void*) noexcept '
                '{ std::terminate(); }\n')
    subprocess.run(["g++", "-shared", "-fPIC", "-O2", source, "-o", library], check=True)
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


@functools.cache  # cffi callbacks must outlive their use
def _silent_log(ffi):
    return ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda level, text, user: None)


def peak_rss_mib() -> float:
    """This process's peak resident memory: VmHWM of /proc/self/status (``ru_maxrss`` would not do:
    Linux keeps it across fork and exec, so a child started by a large parent reports the parent's)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


class LlamaCpp:
    """A GGUF file loaded into llama.cpp: ``threads`` threads, ``n_ctx`` tokens of KV cache shared by
    up to ``sequences`` sequences."""

    def __init__(self, path: str | os.PathLike, threads: int, *, n_ctx: int = 1024, sequences: int = 1) -> None:
        self.lib, self.ffi = lib, ffi = require_library()
        lib.llama_backend_init()
        lib.llama_log_set(_silent_log(ffi), ffi.NULL)
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_threads, params.n_threads_batch = n_ctx, threads, threads
        params.n_seq_max, params.n_batch = sequences, max(n_ctx, 512)
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.vocab = lib.llama_n_vocab(lib.llama_model_get_vocab(self.model))
        self.clear = getattr(lib, "llama_kv_self_clear", None) or lib.llama_kv_cache_clear

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
                logits: Sequence[bool]) -> None:
        lib, n = self.lib, len(tokens)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, (t, p, s, want) in enumerate(zip(tokens, positions, seqs, logits, strict=True)):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
                batch.seq_id[i][0], batch.logits[i] = s, bool(want)
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            lib.llama_batch_free(batch)

    def _logits(self, i: int):  # -> np.ndarray (vocab,) float32, a view of llama.cpp's buffer
        import numpy as np

        return np.frombuffer(self.ffi.buffer(self.lib.llama_get_logits_ith(self.ctx, i), 4 * self.vocab),
                             dtype=np.float32)

    def _argmax(self, i: int) -> int:
        return int(self._logits(i).argmax())

    def greedy_batch(self, prompts: Sequence[Sequence[int]]) -> Callable[[int], list[list[int]]]:
        """``run(n)``: n greedy tokens for each prompt, all decoded together (one sequence each)."""
        def run(n: int) -> list[list[int]]:
            self.clear(self.ctx)
            tokens, positions, seqs, wants = [], [], [], []
            for s, ids in enumerate(prompts):
                tokens += ids
                positions += range(len(ids))
                seqs += [s] * len(ids)
                wants += [False] * (len(ids) - 1) + [True]
            self._decode(tokens, positions, seqs, wants)
            ends = [i for i, w in enumerate(wants) if w]
            out = [[self._argmax(i)] for i in ends]
            lengths = [len(ids) for ids in prompts]
            while len(out[0]) < n:
                step = [row[-1] for row in out]
                self._decode(step, [lengths[s] + len(out[s]) - 1 for s in range(len(prompts))],
                             list(range(len(prompts))), [True] * len(prompts))
                for s in range(len(prompts)):
                    out[s].append(self._argmax(s))
            return out
        return run

    def greedy(self, ids: Sequence[int]) -> Callable[[int], list[int]]:
        """``run(n)``: n greedy tokens after one prompt."""
        run = self.greedy_batch([ids])
        return lambda n: run(n)[0]

    def nll(self, window: Sequence[int]) -> tuple[float, int]:
        """(sum of -log p(token | the ones before it), count) over the window's tokens 1..n-1."""
        self.clear(self.ctx)
        self._decode(window, range(len(window)), [0] * len(window), [True] * len(window))
        import numpy as np

        total = 0.0
        for i in range(len(window) - 1):
            row = self._logits(i).astype(np.float64)
            top = row.max()
            total += top + math.log(np.exp(row - top).sum()) - row[window[i + 1]]
        return total, len(window) - 1


def rss_child(path: str, threads: int) -> None:
    """The measured process of ``generate_q4.peak_memory`` (load, prefill 512, decode 128, print the peak)."""
    LlamaCpp(path, threads).greedy(list(range(100, 612)))(128)
    print(f"peak_rss_mib {peak_rss_mib():.1f}")
