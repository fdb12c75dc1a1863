"""The OpenAI-compatible server:

    python -m jetspec_jax.serve                          # the embedded model and its head, port 8000
    python -m jetspec_jax.serve --model M.gguf --head HEAD_DIR --slots 16 --port 8080
    JETSPEC_API_KEY=secret python -m jetspec_jax.serve --host 0.0.0.0   # /v1 needs 'Authorization: Bearer secret'

SIGINT/SIGTERM stop it gracefully at any moment: during start-up (loading, warm-up) it stops there and
exits; once serving, it stops listening (new connections are refused), running and queued requests finish
within --shutdown-timeout seconds and the rest are cancelled, each answered; a second Ctrl-C quits at once."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import sys
import threading
import time
from typing import Sequence

from jetspec_jax import cache
from jetspec_jax.errors import InputError, OneLineErrorParser, run_command
from jetspec_jax.kv_cache import is_page_size
from jetspec_jax.cli_loading import add_draft_vocab_flag, load_for_cli
from jetspec_jax.serve.limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY_BYTES,
                                      DEFAULT_MAX_CONNECTIONS)
from jetspec_jax.speculative import GEMM_BACKENDS, METHODS

WARMUP_MODES = ("full", "first", "none")


def budget_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {value!r}") from None


def build_parser() -> OneLineErrorParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.serve",
                           description="Serve the target (default: the embedded SmolLM2-135M-Instruct) with "
                                       "speculative decoding behind an OpenAI-compatible HTTP API: "
                                       "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory "
                                                 "(default: $JETSPEC_TARGET or the embedded model)")
    p.add_argument("--head", default=None, help="trained draft head directory (default: the head shipped for "
                                                "the target, else an untrained one)")
    p.add_argument("--method", choices=("auto", "ar") + METHODS, default="auto",
                   help="auto: jetspec when a head ships for the target, else ar (as in jetspec_jax.generate)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JETSPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $JETSPEC_API_KEY, which, unlike the "
                        "flag, other users cannot read in the process list; unset: no key)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; a larger one gets 413")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a client has to send a request's head (from connecting, or from its first byte "
                        "on a kept-alive connection) before it is disconnected")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a client has to send a request's body, from its head, before it is disconnected")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections at which a new request gets 503")
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together; more requests queue")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--max-len", type=int, default=2048, help="cache rows per slot: prompt + answer")
    p.add_argument("--kv-page-size", type=int, default=None,
                   help="keep the target's cache as one pool of pages of this many rows (a power of two >= 16) "
                        "that requests share, each holding the pages its prompt + max_tokens reach; "
                        "default: a dense cache of --slots x --max-len rows")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="pages in the pool with --kv-page-size (default: as many rows as the dense cache); a "
                        "request waits in the queue while too few are free")
    add_draft_vocab_flag(p)
    p.add_argument("--budget", type=budget_arg, default=64,
                   help="tree nodes verified per step, or 'auto' to pick it from the load, plain decoding "
                        "included where no tree pays")
    p.add_argument("--width", type=int, default=7, help="candidates per depth")
    p.add_argument("--chunk-steps", type=int, default=8, help="decode steps per device call between admissions")
    p.add_argument("--max-admit", type=int, default=8, help="queued prompts prefilled together in one device call")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="a prompt longer than this many tokens (a multiple of 64) is prefilled that many at a time "
                        "between decode chunks, so running requests never wait for a whole long prompt")
    p.add_argument("--min-batch", type=int, default=1,
                   help="fewest slot rows a chunk runs (chunks run 1, 2, 4, ... rows, one compilation each); "
                        "--min-batch equal to --slots compiles once")
    p.add_argument("--cost-table", default=None, help="step-cost table for --budget auto")
    p.add_argument("--gemm-backend", choices=("auto",) + tuple(GEMM_BACKENDS), default="auto",
                   help="matmul library of the decode chunks on GPU; auto: cuBLAS where a step verifies >= 128 tokens")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` clients send (default: the model file's name)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="answer length when a request gives none")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on shutdown before they are cancelled")
    p.add_argument("--warmup", choices=WARMUP_MODES, default="first",
                   help="before listening, compile every program a request can need (full: each prompt bucket, "
                        "and each batch size and budget a chunk can use; the slowest start), those of one short "
                        "request (first) or none; a request that needs a program not yet compiled waits for it")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", help="the same as --warmup none")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights/activations (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of an untrained head, when one is used")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    cache.add_cache_flags(p)
    return p


def check_cli_settings(args) -> None:
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
                for name in ("slots", "max_queue", "max_len", "width", "chunk_steps", "max_admit", "prefill_chunk",
                             "min_batch", "default_max_tokens", "max_body_bytes", "max_connections")
                if getattr(args, name) < 1]
    if args.kv_pages is not None and args.kv_page_size is None:
        problems.append("--kv-pages sizes a paged cache: give --kv-page-size too")
    if args.kv_page_size is not None and not is_page_size(args.kv_page_size):
        problems.append(f"--kv-page-size must be a power of two >= 16, got {args.kv_page_size}")
    if args.kv_pages is not None and args.kv_pages < 2:
        problems.append(f"--kv-pages must be >= 2 (one page is scratch), got {args.kv_pages}")
    if args.prefill_chunk >= 1 and args.prefill_chunk % 64:
        problems.append(f"--prefill-chunk must be a multiple of 64 (the prompt bucket), got {args.prefill_chunk}")
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in 0..65535, got {args.port}")
    if not args.shutdown_timeout >= 0:
        problems.append(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    problems += [f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
                 for name in ("header_timeout", "body_timeout") if not getattr(args, name) > 0]
    if problems:
        raise InputError("; ".join(problems))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def warm_up(engine, prompt_ids: list[int], check=lambda: None, timeout: float = 600.0) -> float:
    """One short request through the engine, so that the first client does not wait for compilation.
    `check()` runs between short waits and may raise to stop waiting (StopSignals.check)."""
    import queue

    from jetspec_jax.serve.engine import EngineRequest, FinishEvent

    t0 = time.perf_counter()
    handle = engine.submit(EngineRequest(prompt_ids=prompt_ids, max_new_tokens=4, request_id="warmup"))
    event = None
    while not isinstance(event, FinishEvent):
        check()
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"warm-up request did not finish within {timeout:.0f} s")
        with contextlib.suppress(queue.Empty):
            event = handle.get(timeout=0.2)
    if event.reason == "error":
        raise RuntimeError(f"warm-up request failed: {event.message}")
    seconds = time.perf_counter() - t0
    engine.stats.add_warm_up(seconds)  # /metrics' warm_up_seconds, as the full warm-up records its own
    return seconds


class StopRequested(Exception):
    """A SIGINT or SIGTERM came during start-up."""


class StopSignals:
    """SIGINT and SIGTERM during start-up, until uvicorn installs its own handlers (and after it restores
    these), are recorded and acted on at `check()`, which start-up calls between its steps and while it
    waits for warm-up; a second signal ends the process at once. The handler raises nothing itself:
    Python runs it between any two bytecodes, garbage-collection callbacks included, which print and
    drop an exception (in tries a raised KeyboardInterrupt was lost so, and one caught after it hit an
    import still left the exit status at SIGINT's). SIGINT is taken over even where it was inherited as
    ignored, as a shell script's background job has it: uvicorn takes it over once it serves, and a
    SIGINT during start-up was lost before."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: str | None = None  # the first signal's name
        self.exiting = False  # set once the command is past stopping: any signal ends it at once
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # only it may install handlers
            self.previous = {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, sig, frame) -> None:
        if self.received or self.exiting:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        self.received = signal.Signals(sig).name

    def check(self) -> None:
        if self.received:
            raise StopRequested(self.received)


def serve_command(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_cli_settings(args)
    engine = None
    with StopSignals() as signals:
        try:
            from jetspec_jax.models import qwen3
            from jetspec_jax.serve.engine import Engine
            from jetspec_jax.serve.http_server import GracefulServer, create_app, uvicorn_config
            from jetspec_jax.tokens import encode_prompts

            signals.check()
            cache.configure(args.cache_dir, enabled=not args.no_cache)
            target, method, head = load_for_cli(args)
            if target.tokenizer is None:
                raise InputError(f"{target.source} has no tokenizer; the server needs one to read and write text")
            signals.check()
            target.params = qwen3.fuse_for_decode(target.params)  # the engine's layout: one copy in memory
            engine = Engine(target, head, method=method, slots=args.slots, max_len=args.max_len,
                            budget=args.budget, width=args.width, chunk_steps=args.chunk_steps,
                            max_queue=args.max_queue, cost_table=args.cost_table, min_batch=args.min_batch,
                            gemm_backend=args.gemm_backend, max_admit=args.max_admit,
                            prefill_chunk=args.prefill_chunk, page_size=args.kv_page_size, kv_pages=args.kv_pages)
            engine.start(warm_up=args.warmup == "full")
            if args.warmup == "full":
                print(f"warm-up: compiling every program: {engine.warm_up.describe()}", file=sys.stderr)
                seconds = engine.warm_up.wait(signals.check, progress_bar=True)
                print(f"warm-up (compilation of {engine.warm_up.total} programs) took {seconds:.1f} s",
                      file=sys.stderr)
            elif args.warmup == "first":
                print("warm-up: compiling the first programs", file=sys.stderr)
                seconds = warm_up(engine, encode_prompts(target.tokenizer, ["Hello"])[0], signals.check)
                print(f"warm-up (compilation) took {seconds:.1f} s", file=sys.stderr)
            name = args.served_model_name or target.name
            app = create_app(engine, target.tokenizer, name, default_max_tokens=args.default_max_tokens,
                             shutdown_timeout=args.shutdown_timeout, api_key=args.api_key,
                             max_body_bytes=args.max_body_bytes)
            config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                                    max_connections=args.max_connections)
            print(f"serving {name!r} ({method}, {args.slots} slots) on http://{args.host}:{args.port}/v1"
                  f"{'' if args.api_key is None else ' (API key required)'}", file=sys.stderr)
            if args.api_key is None and not is_loopback(args.host):
                print(f"warning: {args.host} is reachable from other machines and no --api-key is set: anyone "
                      "who reaches the port can use the server", file=sys.stderr)
            signals.check()
            # While it serves, its handlers replace ours and its first signal drains; one that reached ours
            # just before is passed on at its first tick.
            GracefulServer(config, stop_requested=lambda: signals.received is not None).run()
            signals.exiting = True
        except StopRequested as e:
            signals.exiting = True
            print(f"{e}: stopped before serving", file=sys.stderr)
        finally:
            # The app's shutdown stops the engine; a forced exit (second Ctrl-C), a signal during start-up or
            # a failure before the app ran leaves it running, and its requests are cancelled here.
            if engine is not None:
                engine.shutdown(drain=False, timeout=5.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(serve_command, argv)


if __name__ == "__main__":
    sys.exit(main())
