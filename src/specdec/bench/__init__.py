"""Benchmark prompt suites (Spec-Bench style) read from installed data wheels."""
