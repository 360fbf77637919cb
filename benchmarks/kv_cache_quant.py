"""Kept for its command: ``python -m benchmarks.kv_cache --quality`` (the same options)."""

import sys

from benchmarks.kv_cache import main

if __name__ == "__main__":
    main(["--quality", *sys.argv[1:]])
