"""Benchmarks: one script per question, each printing ratios measured side by side in one run."""
