"""Helpers for multi-process tests and examples: spawn ranks on CPU under a hard timeout."""
