"""spendguard's benchmark suite: ``python -m benchmarks.run`` (see benchmarks/README.md)."""
