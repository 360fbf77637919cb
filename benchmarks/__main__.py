"""Run the five peer benchmarks: ``python -m benchmarks [--quick] [--threads N]`` (options go to each).

They are train, decode, attention and kv_cache (train holds benchmarks 1 and 2). The measurements
behind aiayn's own kernels run on their own: ``python -m benchmarks.fast`` (every ``aiayn.fast``
kernel against the plain module it replaces, at 1 and 2 threads), ``benchmarks.matvec``,
``benchmarks.loss``, ``benchmarks.onednn``; SmolLM2 and translation: ``benchmarks/generate.py``,
``benchmarks/translate.py``.
"""

from __future__ import annotations

import sys

from benchmarks import attention, decode, kv_cache, train


def main() -> None:
    args = sys.argv[1:]
    for module in (train, decode, attention, kv_cache):
        module.main(args)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
