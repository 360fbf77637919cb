"""Run the peer benchmarks train, decode, attention and kv_cache: ``python -m benchmarks [--quick]
[--threads N]`` (options go to each)."""

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
