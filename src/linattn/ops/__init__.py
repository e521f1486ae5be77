"""Functional attention ops: pure functions on tensors (no parameters inside)."""
