"""The draft-head trainer: optax AdamW (warmup + cosine, clipping) on fp32 master weights, the frozen
target as teacher computed on the fly, batches of length-bucketed answers from the regenerated corpus,
sharded over a (data, model) device mesh, orbax checkpoints that resume exactly (params, optimizer,
step, data iterator), held-out loss and acceptance per kind of prompt. A config listing both attention
kinds trains a head of each on the same batches, the teacher computed once per step (train_step_heads)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from tqdm import tqdm

from jetspec_jax import sharding
from jetspec_jax.compilation import compile_all, default_workers
from jetspec_jax.errors import InputError
from jetspec_jax.loading.head_checkpoint import load_head_weights, save_head, verify_head_files
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.params import init_params
from jetspec_jax.provenance import file_sha256, write_json_atomic
from jetspec_jax.target import Target

from .config import Bucket, LossConfig, OptimConfig, TrainConfig, check_data_parallel
from .corpus import Corpus
from .data import MODEL_INPUTS, batch_iterator, heldout_batches, make_rows, training_stream
from .heldout import read_pinned
from .loss import draft_loss, per_row_stats, pooled_stats
from .token_counts import write_counts


def head_config_for(cfg: TrainConfig, target_cfg: qwen3.Config) -> draft_head.DraftConfig:
    return draft_head.DraftConfig.for_target(
        target_cfg, num_layers=cfg.head.num_layers, num_taps=cfg.head.num_taps, block_size=cfg.head.block_size,
        attention=cfg.head.attention, intermediate_size=cfg.head.intermediate_size or None)


def make_optimizer(o: OptimConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, max(o.warmup_steps, 1),
                                                  max(o.total_steps, o.warmup_steps + 1), o.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def block_targets(tokens: jax.Array, lengths: jax.Array, anchors: jax.Array, anchor_valid: jax.Array, depth: int):
    """Labels (B, K, D), validity, and the teacher's positions: depth k after anchor a is predicted
    by the target at position a+k-1 and its label is the token at a+k."""
    b, s = tokens.shape
    label_pos = anchors[:, :, None] + jnp.arange(1, depth + 1, dtype=jnp.int32)
    valid = anchor_valid[:, :, None] & (label_pos < lengths[:, None, None])
    labels = jnp.take_along_axis(tokens, jnp.clip(label_pos, 0, s - 1).reshape(b, -1), axis=1)
    return labels.reshape(label_pos.shape), valid, jnp.clip(label_pos - 1, 0, s - 1)


def teacher(target_params, target_cfg: qwen3.Config, tokens: jax.Array, teacher_pos: jax.Array,
            tap_layers: tuple[int, ...]):
    """The frozen target on the whole sequence: logits at the teacher positions and the taps. Causal
    attention of the sequence over itself ("prefill": fused, no (S, S) mask or fp32 scores on GPU)."""
    b, s = tokens.shape
    cache = qwen3.new_cache(target_cfg, b, s, target_params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, taps, _ = qwen3.forward(target_params, tokens, positions, cache, target_cfg, tap_layers=tap_layers,
                                    logits_indices=teacher_pos.reshape(b, -1), attention_impl="prefill")
    return jax.lax.stop_gradient(logits.reshape(teacher_pos.shape + (-1,))), jax.lax.stop_gradient(taps)


def teacher_targets(target_params, batch, *, head_cfg, target_cfg: qwen3.Config):
    """What the heads learn from: labels (B, K, D), their validity, the teacher's logits there and the taps
    the heads read. The heads of a run share block size and taps, so one computation serves them all."""
    labels, valid, teacher_pos = block_targets(batch["tokens"], batch["length"], batch["anchors"],
                                               batch["anchor_valid"], head_cfg.max_depth)
    with jax.named_scope("teacher"):
        teacher_logits, taps = teacher(target_params, target_cfg, batch["tokens"], teacher_pos, head_cfg.tap_layers)
    return labels, valid, teacher_logits, taps


def student_loss(head_params, target_params, batch, targets, *, loss_cfg: LossConfig, head_cfg, target_cfg, dtype,
                 attention: str = "auto"):
    """One head's loss against `teacher_targets`: (loss, (student logits, teacher logits, labels, valid, tree
    logits)). A causal head with loss.tree_causal_weight > 0 also learns the tree-causal pass along the data
    (its logits have the block's layout and targets); for other heads the tree logits are None. `attention`:
    the heads' context attention (head_attention.resolve_training_implementation)."""
    labels, valid, teacher_logits, taps = targets
    compute_params = jax.tree.map(lambda p: p.astype(dtype), head_params)
    loss_of = functools.partial(draft_loss, teacher_logits=teacher_logits, labels=labels, valid=valid,
                                kind=loss_cfg.kind, temperature=loss_cfg.temperature, gamma=loss_cfg.gamma)
    with jax.named_scope("block_pass"):
        student = draft_head.training_logits(compute_params, target_params, target_cfg, batch["tokens"], taps,
                                             batch["anchors"], head_cfg, attention_impl=attention)
        loss, tree = loss_of(student), None
    tree_weight = loss_cfg.for_attention(head_cfg.attention).tree_causal_weight
    if tree_weight:
        with jax.named_scope("tree_pass"):
            tree = draft_head.training_tree_logits(compute_params, target_params, target_cfg, batch["tokens"],
                                                   taps, batch["anchors"], head_cfg, attention_impl=attention)
            loss = loss + tree_weight * loss_of(tree)
    return loss, (student, teacher_logits, labels, valid, tree)


def forward_and_loss(head_params, target_params, batch, *, loss_cfg: LossConfig, head_cfg, target_cfg, dtype,
                     attention: str = "auto"):
    """Returns `student_loss`'s (loss, aux) with the teacher computed here. Gradients flow to head_params only."""
    target_params = jax.lax.stop_gradient(target_params)  # the shared embedding / LM head stay frozen
    targets = teacher_targets(target_params, batch, head_cfg=head_cfg, target_cfg=target_cfg)
    return student_loss(head_params, target_params, batch, targets, loss_cfg=loss_cfg, head_cfg=head_cfg,
                        target_cfg=target_cfg, dtype=dtype, attention=attention)


def batch_token_counts(batch) -> dict[str, jax.Array]:
    """Real tokens (the teacher's non-pad ones) and answer tokens of a global batch, summed on the device."""
    return {"real_tokens": jnp.sum(batch["length"]), "answer_tokens": jnp.sum(batch["length"] - batch["prompt_len"])}


def apply_gradients(params, opt_state, grads, optim: OptimConfig):
    """One head's AdamW update (its own clipping): (new params, new optimizer state)."""
    with jax.named_scope("optimizer"):
        updates, opt_state = make_optimizer(optim).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


# Jitted once per process for each set of static settings (hashable configs), so trainers built for
# the same config (a resumed run, a benchmark's layouts) reuse the compiled programs.
STATIC = ("optim", "loss_cfg", "head_cfg", "target_cfg", "dtype", "attention")


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnums=0)
def train_step(state, target_params, batch, *, optim: OptimConfig, loss_cfg: LossConfig, head_cfg, target_cfg,
               dtype, attention: str = "auto"):
    loss_fn = functools.partial(forward_and_loss, loss_cfg=loss_cfg, head_cfg=head_cfg, target_cfg=target_cfg,
                                dtype=dtype, attention=attention)
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], target_params, batch)
    params, opt_state = apply_gradients(state["params"], state["opt_state"], grads, optim)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **batch_token_counts(batch)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


@functools.partial(jax.jit, static_argnames=("optim", "loss_cfg", "head_cfgs", "target_cfg", "dtype", "attention"),
                   donate_argnums=0)
def train_step_heads(state, target_params, batch, *, optim: OptimConfig, loss_cfg: LossConfig,
                     head_cfgs: tuple[tuple[str, draft_head.DraftConfig], ...], target_cfg, dtype,
                     attention: str = "auto"):
    """train_step for several heads on one batch (state's params and opt_state keyed by head name, as
    head_cfgs): the teacher once, then each head's loss, gradients and AdamW update with its own clipping,
    the same arithmetic as train_step gives that head alone."""
    target_params = jax.lax.stop_gradient(target_params)
    targets = teacher_targets(target_params, batch, head_cfg=head_cfgs[0][1], target_cfg=target_cfg)
    params, opt_state, losses, grad_norms, previous = {}, {}, {}, {}, None
    for name, head_cfg in head_cfgs:
        head_params = state["params"][name]
        # the previous head's gradients before this head's forward pass, so one student's logits are live at a
        # time (GPU keeps barriers until after scheduling; the CPU compiler drops them before)
        if previous is not None:
            head_params, _ = jax.lax.optimization_barrier((head_params, previous))
        loss_fn = functools.partial(student_loss, loss_cfg=loss_cfg, head_cfg=head_cfg, target_cfg=target_cfg,
                                    dtype=dtype, attention=attention)
        with jax.named_scope(name):
            (losses[name], _), grads = jax.value_and_grad(loss_fn, has_aux=True)(head_params, target_params,
                                                                                 batch, targets)
        params[name], opt_state[name] = apply_gradients(state["params"][name], state["opt_state"][name], grads,
                                                        optim)
        grad_norms[name], previous = optax.tree.norm(grads), grads
    metrics = {"loss": losses, "grad_norm": grad_norms, **batch_token_counts(batch)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


@functools.partial(jax.jit, static_argnames=STATIC[1:])
def eval_stats(params, target_params, batch, *, loss_cfg: LossConfig, head_cfg, target_cfg, dtype,
               attention: str = "auto"):
    """`per_row_stats` of the head's block pass, and of its tree-causal pass under "tree_" keys when it learns one."""
    _, (student, teacher_logits, labels, valid, tree) = forward_and_loss(
        params, target_params, batch, loss_cfg=loss_cfg, head_cfg=head_cfg, target_cfg=target_cfg, dtype=dtype,
        attention=attention)
    stats_of = functools.partial(per_row_stats, teacher_logits=teacher_logits, labels=labels, valid=valid,
                                 kind=loss_cfg.kind, temperature=loss_cfg.temperature, gamma=loss_cfg.gamma)
    stats = stats_of(student)
    if tree is not None:
        stats.update({f"tree_{k}": v for k, v in stats_of(tree).items()})
    return stats


# The [head] setting behind each DraftConfig field the config decides (the others follow the target).
SETTING_OF_HEAD_FIELD = {"num_layers": "head.num_layers", "block_size": "head.block_size",
                         "tap_layers": "head.num_taps", "attention": "head.attention",
                         "intermediate_size": "head.intermediate_size"}


def grow_layers(params, head_cfg: draft_head.DraftConfig, seed: int):
    """A shallower head's parameters deepened to head_cfg.num_layers: its layers first, then new ones whose
    attention and MLP outputs (wo, w_down) start at zero, so the grown head computes what the shallower
    one did and training opens the new layers from there."""
    fresh = init_params(draft_head.param_specs(head_cfg), jax.random.key(seed), jnp.float32)["layers"]
    added = [{**layer, "wo": jnp.zeros_like(layer["wo"]), "w_down": jnp.zeros_like(layer["w_down"])}
             for layer in fresh[len(params["layers"]):]]
    return {**params, "layers": list(params["layers"]) + added}


def trim_none(spec) -> tuple:
    spec = tuple(spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@dataclasses.dataclass
class Trainer:
    """The device placement and static settings of one config and target, around train_step / eval_stats
    (train_step_heads for a config of several heads: state and parameters keyed by head name)."""

    cfg: TrainConfig
    target: Target
    mesh: jax.sharding.Mesh

    def __post_init__(self):
        # each head's DraftConfig by name, in the config's order (one entry for a single head)
        self.heads = {name: head_config_for(alone, self.target.cfg) for name, alone in self.cfg.single_heads().items()}
        for head_cfg in self.heads.values():
            draft_head.check_pairing(head_cfg, self.target.cfg)
        self.head_cfg = next(iter(self.heads.values()))  # a single head's
        self.dtype = jnp.dtype(self.cfg.run.compute_dtype)
        self.optimizer = make_optimizer(self.cfg.optim)
        # specs without trailing Nones, as jit returns them: P(None, None) and P() are the same layout but
        # not the same cache key, and a step whose output differs from its input would compile twice
        self.param_shardings = {name: jax.tree.map(
            lambda s: jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*trim_none(s.spec))),
            sharding.param_shardings(draft_head.param_specs(head_cfg), self.mesh))
            for name, head_cfg in self.heads.items()}
        self.target_params = jax.device_put(
            jax.tree.map(lambda p: p.astype(self.dtype), self.target.params),
            sharding.param_shardings(qwen3.param_specs(self.target.cfg), self.mesh))
        self.static = dict(loss_cfg=self.cfg.loss, head_cfg=self.head_cfg, target_cfg=self.target.cfg,
                           dtype=self.dtype, attention=self.cfg.run.attention)
        # executables from compile_ahead: ("train", row length) and ("eval", head name, row length)
        self.ahead: dict[tuple, Any] = {}

    def init_state(self, seed: int, params=None) -> dict[str, Any]:
        """Head parameters (random from `seed`, or `params`, e.g. warm_start_params') and a fresh optimizer
        state, placed by their shardings (built op by op: a head is small, and a jitted init would compile
        again for every trainer). Several heads: `params` maps head names to parameters (absent or None:
        random), and every head starts as it would alone."""
        def head_params(name, given):
            if given is None:
                given = init_params(draft_head.param_specs(self.heads[name]), jax.random.key(seed), jnp.float32)
            return jax.device_put(given, self.param_shardings[name])

        if self.cfg.is_pair:
            params = {name: head_params(name, (params or {}).get(name)) for name in self.heads}
            opt_state = {name: self.optimizer.init(p) for name, p in params.items()}
        else:
            params = head_params(next(iter(self.heads)), params)
            opt_state = self.optimizer.init(params)
        state = {"params": params, "opt_state": opt_state, "step": jnp.int32(0)}
        # every leaf on the mesh, as train_step returns them (a scalar left on one device would compile twice)
        return jax.device_put(state, jax.tree.map(lambda x: x.sharding if isinstance(
            x.sharding, jax.sharding.NamedSharding) else sharding.replicated(self.mesh), state))

    def warm_start_params(self) -> tuple[Any, dict[str, Any]]:
        """fp32 master weights from the exported head at head.init_from, and what they are (path, sha256,
        layers). Refused unless that head has this config's shape, but for fewer layers (grown by
        grow_layers), and was trained for this target. Several heads: both keyed by the names of the heads
        that have a head.init_from entry."""
        if not self.cfg.is_pair:
            return self.head_weights(self.cfg.head.init_from, self.head_cfg)
        loaded = {name: self.head_weights(alone.head.init_from, self.heads[name])
                  for name, alone in self.cfg.single_heads().items() if alone.head.init_from}
        return {name: p for name, (p, _) in loaded.items()}, {name: r for name, (_, r) in loaded.items()}

    def head_weights(self, path: str, head_cfg: draft_head.DraftConfig) -> tuple[Any, dict[str, Any]]:
        """One warm-start head (warm_start_params) for the head of head_cfg."""
        fix = ("point head.init_from at a head exported (run.export_head) for this target with this [head] "
               "shape, or set head.init_from=\"\" to start from random weights")
        try:
            record = verify_head_files(path)
        except FileNotFoundError as e:
            raise InputError(f"head.init_from={path!r}: {e}; {fix}") from None
        problems = []
        if record.target_fingerprint is not None and record.target_fingerprint != self.target.fingerprint:
            problems.append(f"it was trained for target {record.target_name!r} (fingerprint "
                            f"{record.target_fingerprint}), not {self.target.name!r} ({self.target.fingerprint})")
        grows = record.cfg.num_layers < head_cfg.num_layers
        problems += [f"{f.name} is {getattr(record.cfg, f.name)!r} there, {getattr(head_cfg, f.name)!r} here"
                     + (f" ({SETTING_OF_HEAD_FIELD[f.name]})" if f.name in SETTING_OF_HEAD_FIELD else "")
                     for f in dataclasses.fields(draft_head.DraftConfig)
                     if getattr(record.cfg, f.name) != getattr(head_cfg, f.name)
                     and not (f.name == "num_layers" and grows)]
        if problems:
            raise InputError(f"head.init_from={path!r}: the exported head does not fit this run: "
                             f"{'; '.join(problems)}; {fix}")
        params = load_head_weights(record, jnp.float32)
        if grows:
            params = grow_layers(params, head_cfg, self.cfg.run.seed)
        return params, {"path": os.path.abspath(path), "weights_sha256": record.weights_digest(),
                        "layers": record.cfg.num_layers}

    def place_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Splits the batch's model inputs over the data axis (each process gives its local rows)."""
        return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(self.mesh, np.ndim(local_batch[k])),
                                                          np.asarray(local_batch[k]))
                for k in MODEL_INPUTS}

    def step_function(self) -> tuple[Callable, dict[str, Any]]:
        """The jitted train step of this config and its static settings."""
        if self.cfg.is_pair:
            return train_step_heads, dict(optim=self.cfg.optim, loss_cfg=self.cfg.loss,
                                          head_cfgs=tuple(self.heads.items()), target_cfg=self.target.cfg,
                                          dtype=self.dtype, attention=self.cfg.run.attention)
        return train_step, dict(optim=self.cfg.optim, **self.static)

    def train_step(self, state, batch):
        with jax.set_mesh(self.mesh):
            placed = self.place_batch(batch)
            compiled = self.ahead.get(("train", batch["tokens"].shape[1]))
            if compiled is not None:
                return compiled(state, self.target_params, placed)
            step, static = self.step_function()
            return step(state, self.target_params, placed, **static)

    def abstract_batch(self, bucket: Bucket) -> dict[str, jax.ShapeDtypeStruct]:
        """A whole batch of `bucket` as place_batch lays it out on the mesh."""
        rows = make_rows([None] * bucket.rows, bucket, [None] * bucket.rows)
        return {k: jax.ShapeDtypeStruct(rows[k].shape, rows[k].dtype,
                                        sharding=sharding.batch_sharding(self.mesh, rows[k].ndim))
                for k in MODEL_INPUTS}

    def compile_ahead(self, state, buckets: list[Bucket], eval_lengths: set[int], workers: int) -> dict[str, Any]:
        """Compiles the train step for every bucket and each head's held-out program for the `eval_lengths`
        buckets, `workers` at a time, before the first step (at their first calls they compile one at a
        time, inside the timed run). Returns the programs' count and the seconds it took."""
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        state_shape, (step, step_static) = abstract(state), self.step_function()
        params_of = {name: state_shape["params"][name] if self.cfg.is_pair else state_shape["params"]
                     for name in self.heads}
        by_length = {b.length: b for b in buckets}
        items = [("train", b.length) for b in buckets] + [
            ("eval", name, length) for name in self.heads for length in sorted(eval_lengths)]

        def lower(item):
            batch = self.abstract_batch(by_length[item[-1]])
            if item[0] == "train":
                return step.lower(state_shape, self.target_params, batch, **step_static)
            return eval_stats.lower(params_of[item[1]], self.target_params, batch,
                                    **{**self.static, "head_cfg": self.heads[item[1]]})

        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            done = compile_all(items, lower, workers)
        self.ahead.update(done)
        return {"programs_compiled_ahead": len(done), "compile_seconds": time.perf_counter() - start}

    def evaluate(self, params, batches: list[dict]) -> dict[str, Any]:
        """Held-out loss, expected chain tau and per-depth acceptance, over all rows and per kind of prompt
        (`eval_by_head`: these per head, for several heads). Every process holds every held-out batch and
        gives its own rows of each."""
        if self.cfg.is_pair:
            return {"eval_by_head": {name: self.evaluate_head(params[name], batches, name) for name in self.heads}}
        return self.evaluate_head(params, batches, next(iter(self.heads)))

    def evaluate_head(self, params, batches: list[dict], name: str) -> dict[str, Any]:
        """`evaluate` for the head `name` (the teacher computed anew for each: it is a small part of a rare
        step)."""
        rows, kinds = collections.defaultdict(list), []
        index, count = jax.process_index(), jax.process_count()
        static = {**self.static, "head_cfg": self.heads[name]}
        with jax.set_mesh(self.mesh):
            for batch in batches:
                per = len(batch["tokens"]) // count
                local = {k: v[index * per:(index + 1) * per] for k, v in batch.items()}
                program = self.ahead.get(("eval", name, batch["tokens"].shape[1]))
                placed = self.place_batch(local)
                stats = (program(params, self.target_params, placed) if program is not None
                         else eval_stats(params, self.target_params, placed, **static))
                stats = jax.device_get(stats) if count == 1 else multihost_utils.process_allgather(stats, tiled=True)
                for k, v in stats.items():
                    rows[k].append(np.asarray(v))
                kinds.extend(batch["kind"].tolist())
        stats = {k: np.concatenate(v) for k, v in rows.items()}
        tree = {k.removeprefix("tree_"): v for k, v in stats.items() if k.startswith("tree_")}
        block = {k: v for k, v in stats.items() if not k.startswith("tree_")}
        kinds = np.asarray(kinds)

        def pooled(rows):
            """pooled_stats of the block pass, and the tree-causal pass's loss, chain tau and per-depth
            acceptance when the head learns one (teacher-forced: each depth sees the true tokens before it)."""
            out = pooled_stats(block, rows)
            if tree:
                tree_stats = pooled_stats(tree, rows)
                out.update(tree_loss=tree_stats["loss"], tree_expected_tau=tree_stats["expected_tau"],
                           tree_accept_per_depth=tree_stats["accept_per_depth"])
            return out

        overall = pooled(kinds != "")
        by_kind = {kind: {**pooled(kinds == kind), "answers": int(np.sum(kinds == kind))}
                   for kind in sorted(set(kinds.tolist()) - {""})}
        return {"eval_loss": overall["loss"], "eval_expected_tau": overall["expected_tau"],
                "eval_accept_per_depth": overall["accept_per_depth"], "eval_answers": int(np.sum(kinds != "")),
                **{f"eval_{k}": v for k, v in overall.items() if k.startswith("tree_")}, "eval_by_kind": by_kind}


def corpus_fingerprint(corpus: Corpus) -> str:
    """The corpus's identity: its prompts and answer shards as the manifest hashes them."""
    m = corpus.manifest
    ids = [m["prompts_sha256"]] + [shard["sha256"] for shard in m["shards"]]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


class Checkpoints:
    """orbax CheckpointManager around (train state, data-iterator state and counters, run metadata)."""

    def __init__(self, directory: str, cfg: TrainConfig, target_cfg: qwen3.Config, corpus: str):
        self.fingerprint = cfg.fingerprint()
        self.target = repr(target_cfg)
        self.corpus = corpus
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.run.keep_checkpoints,
                                               save_interval_steps=cfg.run.checkpoint_every,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        meta = {"fingerprint": self.fingerprint, "target": self.target, "corpus": self.corpus,
                "config": self.cfg.to_dict(), "step": step}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, abstract_state):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        where = f"checkpoint at step {step} in {self.manager.directory}"
        if meta["target"] != self.target:
            raise ValueError(f"{where} trains a head for another target ({meta['target']}), not {self.target}; set "
                             "run.target to that model or use a new run.name")
        if meta["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"{where} was made with another config (fingerprint {meta['fingerprint']} != {self.fingerprint}); "
                "use a new run.name or run.out_dir, or restore the config it was trained with")
        if meta.get("corpus") != self.corpus:
            raise ValueError(f"{where} was trained on another corpus ({meta.get('corpus')} != {self.corpus}): its "
                             "data order would not continue; use a new run.name or the corpus it was trained on")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


class StopRequest:
    """SIGTERM during training asks for a clean stop: the loop ends after its current step with the
    held-out eval, a checkpoint and the export, as a time box would (off the main thread: never set)."""

    def __init__(self):
        self.requested = False
        self.previous = None

    @classmethod
    def on_sigterm(cls) -> "StopRequest":
        request = cls()
        if threading.current_thread() is threading.main_thread():
            request.previous = signal.signal(signal.SIGTERM, lambda *_: setattr(request, "requested", True))
        return request

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def recorded_warm_start(path: str) -> dict[str, str] | None:
    """The exported head a run started from, as its metrics' step-0 row records it (None: random init)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return next((row["warm_start"] for row in map(json.loads, f) if "warm_start" in row), None)


def truncate_metrics(path: str, last_step: int) -> None:
    """On resume, forget metrics logged after the restored checkpoint (they will be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if json.loads(line).get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


def check_batch_size(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> None:
    """Every bucket's rows split evenly over the data-parallel devices and processes (checked before the
    target loads)."""
    check_data_parallel(cfg, mesh.shape[sharding.DATA_AXIS], jax.process_count())


class TokenCounter:
    """Real and answer tokens trained on: per-step device sums, fetched only where the loop waits anyway
    (a log line, a checkpoint), so counting never stalls the device."""

    def __init__(self, seen: dict | None = None):
        self.pending: list[dict] = []
        self.seen = {"real_tokens": 0, "answer_tokens": 0, "padded_tokens": 0, **(seen or {})}
        self.window = dict.fromkeys(self.seen, 0)

    def add(self, metrics: dict, padded_tokens: int) -> None:
        self.pending.append({"real_tokens": metrics["real_tokens"], "answer_tokens": metrics["answer_tokens"]})
        self.window["padded_tokens"] += padded_tokens
        self.seen["padded_tokens"] += padded_tokens

    def flush(self) -> None:
        for counts in jax.device_get(self.pending):
            for k, v in counts.items():
                self.window[k] += int(v)
                self.seen[k] += int(v)
        self.pending = []

    def take_window(self) -> dict:
        self.flush()
        window, self.window = self.window, dict.fromkeys(self.seen, 0)
        return window


def loss_fields(metrics: dict, by_head: bool) -> dict[str, Any]:
    """A metrics row's training loss and gradient norm: `loss`, `grad_norm`, or for several heads
    `loss_by_head`, `grad_norm_by_head`. Fetching them waits for the step."""
    got = jax.device_get({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
    if not by_head:
        return {"loss": float(got["loss"]), "grad_norm": float(got["grad_norm"])}
    return {f"{k}_by_head": {name: float(v) for name, v in got[k].items()} for k in ("loss", "grad_norm")}


def progress_fields(row: dict, last_eval: dict) -> dict[str, str]:
    """The progress bar's loss, rate and latest held-out tau (loss/tau per head for several heads)."""
    if "loss" in row:
        return {"loss": f"{row['loss']:.4f}", "tok_s": f"{row['tokens_per_s']:.0f}",
                "tau": f"{last_eval.get('eval_expected_tau', float('nan')):.2f}"}
    evals = last_eval.get("eval_by_head", {})
    return {"tok_s": f"{row['tokens_per_s']:.0f}",
            **{name: f"{loss:.4f} tau {evals.get(name, {}).get('eval_expected_tau', float('nan')):.2f}"
               for name, loss in row["loss_by_head"].items()}}


def summary_of_head(summary: dict, name: str, heads: list[str]) -> dict:
    """One head's part of a several-head run's summary, as its own run's summary would read (its held-out
    numbers and warm start at the top level), naming the heads it trained with."""
    own = {k: v for k, v in summary.items() if k not in ("eval_by_head", "warm_start")}
    own.update(summary.get("eval_by_head", {}).get(name, {}))
    if name in summary.get("warm_start", {}):
        own["warm_start"] = summary["warm_start"][name]
    return {**own, "head": name, "trained_with": heads}


def export_heads(cfg: TrainConfig, trainer: "Trainer", params, summary: dict, target: Target, corpus: Corpus,
                 directories: dict[str, str]) -> None:
    """Each named head's weights (bf16) into its directory, with the run's config and summary beside them."""
    for name, directory in directories.items():
        weights = jax.tree.map(lambda p: np.asarray(p, dtype=jnp.bfloat16), params[name] if cfg.is_pair else params)
        save_head(directory, trainer.heads[name], weights,
                  metadata={"config": json.dumps(cfg.to_dict()),
                            "summary": json.dumps(summary_of_head(summary, name, list(trainer.heads))
                                                  if cfg.is_pair else summary),
                            "target": target.name, "corpus": corpus_fingerprint(corpus)}, target=target)


def train(cfg: TrainConfig, target: Target, corpus: Corpus, *, mesh=None,
          stop_after: int | None = None, on_step: Callable[[int, dict], None] | None = None,
          snapshot_minutes: float = 0.0,
          on_snapshot: Callable[[dict, Callable[[list[str]], None]], None] | None = None) -> dict:
    """Trains on `corpus.answers("train")` (resuming from the run directory's latest checkpoint), measures
    on `corpus.answers("heldout")` every run.eval_every steps, and exports the head (each head of a config
    listing several to its run.export_head entry). `stop_after` ends the process early without a final
    save (used to test kill-and-resume). Every `snapshot_minutes` of training, `on_snapshot(progress,
    write_heads)` gets the summary so far and a function that exports the heads as they are now (bf16,
    one directory per head, in the order of run.export_head), so a run that never ends still leaves them."""
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    os.makedirs(run_dir, exist_ok=True)
    mesh = sharding.make_mesh(cfg.run.mesh_model) if mesh is None else mesh
    check_batch_size(cfg, mesh)
    buckets = cfg.buckets()
    stream = training_stream(corpus.answers("train"), buckets, mixture=cfg.data.mixture, seed=cfg.run.seed,
                             process_index=jax.process_index(), process_count=jax.process_count())
    heldout = read_pinned(cfg.data.heldout_answers, corpus) if cfg.data.heldout_answers else corpus.answers("heldout")
    eval_batches = heldout_batches(heldout, buckets, per_kind=cfg.run.eval_answers_per_kind, seed=cfg.run.seed)
    trainer = Trainer(cfg, target, mesh)
    ckpt = Checkpoints(os.path.join(run_dir, "checkpoints"), cfg, target.cfg, corpus_fingerprint(corpus))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    data_state, starting_row = None, None
    start = ckpt.latest_step()
    if start is not None:
        state = trainer.init_state(cfg.run.seed)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state, data_state = ckpt.restore(start, abstract)
        truncate_metrics(metrics_path, start)
        warm_start = recorded_warm_start(metrics_path)
    else:
        start = 0
        params, warm_start = trainer.warm_start_params() if cfg.head.init_from else (None, None)
        state = trainer.init_state(cfg.run.seed, params)
        write_json_atomic(os.path.join(run_dir, "config.json"), cfg.to_dict())
        with contextlib.suppress(FileNotFoundError):  # no checkpoint: an earlier attempt's rows are stale
            os.remove(metrics_path)
        starting_row = {"step": 0, "warm_start": warm_start} if warm_start else None
    write_json_atomic(os.path.join(run_dir, "data_plan.json"), {
        "corpus": corpus_fingerprint(corpus), "corpus_dir": os.path.abspath(corpus.out_dir),
        "buckets": [b._asdict() for b in buckets], **stream.plan,
        **({"heldout_answers": {"file": cfg.data.heldout_answers, "sha256": file_sha256(cfg.data.heldout_answers)}}
           if cfg.data.heldout_answers else {}),
        "heldout_answers_per_kind": dict(collections.Counter(
            kind for b in eval_batches for kind in b["kind"].tolist() if kind))})
    # a slice keeps each step's global index, so its anchors are those the whole stream would draw there
    dataset = stream.dataset[cfg.data.start_step:] if cfg.data.start_step else stream.dataset
    batches = batch_iterator(dataset, data_state and data_state["iterator"])
    counter = TokenCounter(data_state and data_state["tokens_seen"])
    tokens_before = counter.seen["real_tokens"]
    # training time before this run (from the checkpoint), so a resumed run's metrics continue its clock
    seconds_before = (data_state or {}).get("train_seconds", 0.0)
    rows_of = {b.length: b.rows for b in buckets}

    def data_state_now():
        counter.flush()
        return {"iterator": batches.get_state(), "tokens_seen": dict(counter.seen),
                "train_seconds": seconds_before + time.perf_counter() - t_start}

    workers = default_workers()
    ahead = trainer.compile_ahead(state, buckets, {b["tokens"].shape[1] for b in eval_batches}, workers)
    print(f"compiled {ahead['programs_compiled_ahead']} programs in {ahead['compile_seconds']:.1f} s, "
          f"{workers} at a time", file=sys.stderr)
    if starting_row is not None:
        # the warm start's own held-out numbers, so that the run's first evaluation has its baseline
        if eval_batches:
            starting_row.update(trainer.evaluate(state["params"], eval_batches))
        append_jsonl(metrics_path, starting_row)
    bar = tqdm(total=cfg.optim.total_steps, initial=start, desc=cfg.run.name, dynamic_ncols=True)
    t_start = t_last = t_snapshot = time.perf_counter()  # run.max_minutes and the rates count from here, all compiled

    def summary_now(step: int) -> dict:
        counter.flush()
        seconds_this_run = time.perf_counter() - t_start  # read once, so the two fields below agree
        summary = {"steps": step, "steps_this_run": step - start, "tokens_seen": counter.seen["real_tokens"],
                   "tokens_seen_this_run": counter.seen["real_tokens"] - tokens_before,
                   "answer_tokens_seen": counter.seen["answer_tokens"], "mesh": dict(mesh.shape),
                   "devices": [d.device_kind for d in mesh.devices.flat],
                   "train_seconds": seconds_before + seconds_this_run, "train_seconds_this_run": seconds_this_run,
                   "compile_seconds_this_run": round(ahead["compile_seconds"], 2), **last_eval}
        if warm_start:
            summary["warm_start"] = warm_start
        return summary

    last_eval, step = {}, start
    terminated = StopRequest.on_sigterm()
    while step < cfg.optim.total_steps:
        step += 1
        batch = next(batches)
        state, metrics = trainer.train_step(state, batch)
        counter.add(metrics, rows_of[batch["tokens"].shape[1]] * batch["tokens"].shape[1])
        stop_early = ((cfg.run.max_minutes > 0 and time.perf_counter() - t_start > 60 * cfg.run.max_minutes)
                      or 0 < cfg.run.max_steps <= step or terminated.requested)
        last = step == cfg.optim.total_steps or stop_early
        if step % cfg.run.log_every == 0 or last or on_step is not None:
            losses = loss_fields(metrics, cfg.is_pair)  # waits for the step: the rates below are device-bound
            now = time.perf_counter()
            window, seconds = counter.take_window(), max(now - t_last, 1e-9)
            row = {"step": step, **losses,
                   "tokens_per_s": window["real_tokens"] / seconds,
                   "answer_tokens_per_s": window["answer_tokens"] / seconds,
                   "padded_tokens_per_s": window["padded_tokens"] / seconds,
                   "pad_fraction": 1 - window["real_tokens"] / max(window["padded_tokens"], 1),
                   "tokens_seen": counter.seen["real_tokens"], "answer_tokens_seen": counter.seen["answer_tokens"],
                   "train_seconds": seconds_before + now - t_start}
            if eval_batches and (step % cfg.run.eval_every == 0 or last):
                last_eval = trainer.evaluate(state["params"], eval_batches)
                row.update(last_eval)
            t_last = time.perf_counter()  # the eval's time is not the training rate's
            append_jsonl(metrics_path, row)
            bar.set_postfix(progress_fields(row, last_eval))
            if on_step is not None:
                on_step(step, row)
        bar.update(1)
        if ckpt.manager.should_save(step):
            ckpt.save(step, state, data_state_now())
        if on_snapshot is not None and not last and time.perf_counter() - t_snapshot >= 60 * snapshot_minutes:
            progress, params = summary_now(step), state["params"]
            on_snapshot(progress, lambda dirs: export_heads(cfg, trainer, params, progress, target, corpus,
                                                            dict(zip(trainer.heads, dirs))))
            t_snapshot = time.perf_counter()
        if stop_after is not None and step >= stop_after:
            terminated.restore()
            ckpt.wait()
            ckpt.close()
            bar.close()
            return {"stopped_at": step}
        if stop_early:
            break
    terminated.restore()
    ckpt.wait()
    if step not in ckpt.manager.all_steps():
        ckpt.save(step, state, data_state_now(), force=True)
        ckpt.wait()
    ckpt.close()
    bar.close()
    summary = summary_now(step)
    directories = {name: alone.run.export_head for name, alone in cfg.single_heads().items() if alone.run.export_head}
    export_heads(cfg, trainer, state["params"], summary, target, corpus, directories)
    exported = list(directories.values())
    if exported:  # beside each head, its corpus's token counts: what --draft-vocab picks from
        write_counts(corpus, exported, target.fingerprint)
    if cfg.run.export_head:
        summary["exported_head"] = cfg.run.export_head
    return summary
