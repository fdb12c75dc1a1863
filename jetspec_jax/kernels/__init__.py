"""Pallas GPU kernels (tree attention, tree build, cache compaction), each with a plain-jnp reference
and an entry point that runs the reference off the GPU."""
