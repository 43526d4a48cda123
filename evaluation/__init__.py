"""Evaluation of hf_sparse_kv: real assets, prompts, metrics and the recipes' building blocks."""
