"""GSM8K accuracy through the OpenAI-compatible server at a concurrency, beside offline AR generation:
batching must not change answers (a third-party test of another tree-speculation server found its
accuracy fall from 85% to 10-16% above batch 1).

    python benchmarks/serve_accuracy.py --variants ar 32 auto --concurrency 32 --limit 256 \\
        --out benchmarks/results/serve_accuracy_h200.json

Each variant is a server on 127.0.0.1 (serve_load.py's LiveServer: the real app and engine, full
warm-up), sent the first --limit GSM8K test questions as greedy chat requests, --concurrency of them
in flight; offline AR (api.generate, --concurrency prompts a batch) answers the same questions. Each
row gives the accuracy, and the share of answers whose text equals offline AR's: all of them in fp32;
in bf16 a near-tie between two tokens can fall either way in a differently shaped program
(docs/lossless.md), so a few may part there and the accuracies agree within noise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, target_and_head, write_json_atomic  # noqa: E402
from serve_load import LiveServer, add_server_flags, parse_variant  # noqa: E402

from jetspec_jax import cache  # noqa: E402
from jetspec_jax.eval.datasets import load_benchmark  # noqa: E402
from jetspec_jax.eval.scoring import gsm8k_correct  # noqa: E402


async def ask_all(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> list[str]:
    """Every prompt as a greedy chat request, `concurrency` in flight; the answers in prompt order."""
    import httpx

    answers: list[str | None] = [None] * len(prompts)
    todo = list(range(len(prompts)))[::-1]
    async with httpx.AsyncClient(timeout=1200) as client:
        async def worker():
            while todo:
                i = todo.pop()
                body = dict(model="target", messages=[{"role": "user", "content": prompts[i]}],
                            max_tokens=max_tokens, temperature=0)
                response = await client.post(url, json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
                answers[i] = response.json()["choices"][0]["message"]["content"]
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


def offline_answers(target, prompts: list[str], batch: int, max_tokens: int) -> list[str]:
    from jetspec_jax.api import generate

    texts = []
    for start in range(0, len(prompts), batch):
        texts += generate(prompts[start:start + batch], target, max_new_tokens=max_tokens).texts
    return texts


def score(variant: str, answers: list[str], references: list[str], offline: list[str]) -> dict:
    correct = [gsm8k_correct(a, r)[0] for a, r in zip(answers, references)]
    return dict(variant=variant, questions=len(answers), correct=sum(correct), accuracy=sum(correct) / len(answers),
                same_as_offline_ar=sum(a == o for a, o in zip(answers, offline)) / len(answers))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_flags(p)
    p.add_argument("--variants", nargs="+", default=["ar", "32", "auto"], help="as serve_load.py's")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--limit", type=int, default=256, help="the first N GSM8K test questions")
    p.add_argument("--max-tokens", type=int, default=384)
    args = p.parse_args(argv)
    for variant in args.variants:
        parse_variant(variant)
    cache.configure(args.cache_dir, enabled=not args.no_cache)
    target, head = target_and_head(args.model, args.head, args.method)
    items = load_benchmark("gsm8k", args.data_dir, limit=args.limit)
    prompts, references = [item.prompt for item in items], [item.reference for item in items]

    offline = offline_answers(target, prompts, args.concurrency, args.max_tokens)
    rows = [score("offline ar", offline, references, offline)]
    payload = dict(benchmark="serve_accuracy", target=target.name, method=args.method, slots=args.slots,
                   concurrency=args.concurrency, max_tokens=args.max_tokens, environment=environment(), rows=rows)
    for variant in args.variants:
        server = LiveServer(target, head, variant, args)
        try:
            answers = asyncio.run(ask_all(server.url, prompts, args.concurrency, args.max_tokens))
        finally:
            server.close()
        rows.append(score(variant, answers, references, offline))
        print(rows[-1], flush=True)
        if args.out:
            write_json_atomic(args.out, payload)
    print_table(rows, ["variant", "questions", "correct", "accuracy", "same_as_offline_ar"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
