"""Benchmarks of aiayn against its peers (torch.nn.Transformer, Hugging Face, x-transformers), and
of aiayn.fast's kernels against the plain modules they replace (``benchmarks.fast``).

Scripts, not tests: each prints markdown tables and ratios. Run from the repository root, e.g.
``python -m benchmarks.train --quick``; ``python -m benchmarks`` runs the five peer benchmarks.
"""
