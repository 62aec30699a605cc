"""Slow per-token reference loops: the oracles the vectorised ``copc.ops`` code is tested against.

Each function walks one sequence token by token in plain Python floats, exactly as the formula in
docs/algorithms.md reads. They live only in the tests (CONTRIBUTING.md#one-formula-one-place).
"""
