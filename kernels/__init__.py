"""Triton kernels for the CUDA attention path (docs/kernels.md); one op per module, imported explicitly.

Kept empty of imports on purpose: transformers probes for a package named ``kernels``, and importing triton
here would slow every ``import kvscope.engine`` down. ``kvscope.kernels`` imports only torch and triton.
"""
