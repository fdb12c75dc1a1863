"""Pallas GPU kernels for tree attention, each beside its plain-jnp reference."""
