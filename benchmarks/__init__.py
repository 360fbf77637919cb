"""Benchmarks of aiayn against its peers (torch.nn.Transformer, Hugging Face, x-transformers).

Scripts, not tests: each prints markdown tables and ratios. Run from the repository root, e.g.
``python -m benchmarks.train --quick``; ``python -m benchmarks`` runs them all.
"""
