"""Where a decode step's time goes: kernels XLA launches per step, by kind, and the step time of
variants, on random weights of the embedded model's shape (timing does not depend on values).

    python benchmarks/decode_profile.py
"""

from __future__ import annotations

import collections
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import time_call  # noqa: E402
from shapes import SMOLLM2_135M  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.target import default_dtype  # noqa: E402


def entry_kernels(compiled_text: str) -> collections.Counter:
    entry = compiled_text[compiled_text.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    names = collections.Counter()
    for name, op in re.findall(r"\n\s*%?([\w.\-]+)\s*=\s*\S+\s+([a-z\-]+)\(", entry):
        if op in ("parameter", "tuple", "get-tuple-element", "constant", "bitcast"):
            continue
        names[re.sub(r"[.\d]+$", "", name) + f" [{op}]"] += 1
    return names


def main():
    cfg = SMOLLM2_135M
    dtype = default_dtype()
    params = init_params(qwen3.param_specs(cfg), jax.random.key(0), dtype)
    fused = qwen3.fuse_for_decode(params)
    for batch, cache_len in ((1, 320), (8, 384)):
        cache = qwen3.new_cache(cfg, batch, cache_len, dtype)._replace(lengths=jnp.full((batch,), 100, jnp.int32))
        tokens = jnp.zeros((batch, 1), jnp.int32)

        def step(p, tokens, cache):
            return qwen3.forward(p, tokens, cache.lengths[:, None], cache, cfg)

        jitted = jax.jit(step)
        for label, p in (("unfused", params), ("fused", fused)):
            text = jitted.lower(p, tokens, cache).compile().as_text()
            kernels = entry_kernels(text)
            t = time_call(lambda: jitted(p, tokens, cache), warmup=3, repeats=20)
            print(f"\n== batch {batch} {label}: {sum(kernels.values())} kernels/step, single jitted step "
                  f"{t * 1e3:.3f} ms")
            for name, n in kernels.most_common(40):
                print(f"  {n:5d}  {name}")
        prompt = jnp.ones((batch, 64), jnp.int32)
        lens = jnp.full((batch,), 60, jnp.int32)
        for n_new in (1, 129):
            gen = GenerationConfig(max_new_tokens=n_new)
            t = time_call(lambda: generate_tokens(params, prompt, lens, jax.random.key(0), cfg=cfg, gen=gen,
                                                  cache_len=cache_len), repeats=5)
            print(f"generate_tokens batch {batch} new={n_new}: {t * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
