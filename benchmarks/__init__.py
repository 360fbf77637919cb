"""Benchmarks of aiayn against its peers and of aiayn.fast's kernels against the plain modules they
replace. Scripts, not tests: each prints markdown tables and ratios (``python -m benchmarks.NAME``).
"""
