"""Pallas GPU kernels of hisparse-jax, each beside its jnp reference.

This package knows nothing of the host-tier coordinator; the public, validated entry points
live in `hisparse_jax`.
"""
