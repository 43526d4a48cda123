"""Triton kernels of the sparse-KV ops; each function has the signature of its twin in ``..reference``."""
