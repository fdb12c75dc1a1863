"""The draft-head trainer: optax AdamW (warmup + cosine, clipping) on fp32 master weights, the frozen
target as teacher computed on the fly, sharded over a (data, model) device mesh, orbax checkpoints
that resume exactly (params, optimizer, step, data iterator)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jetspec_jax import sharding
from jetspec_jax.loading.head_checkpoint import save_head
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.params import init_params
from jetspec_jax.provenance import write_json_atomic
from jetspec_jax.target import Target

from .config import TrainConfig
from .data import batch_iterator, heldout_batches, split_heldout, training_dataset
from .loss import acceptance_stats, draft_loss


def head_config_for(cfg: TrainConfig, target_cfg: qwen3.Config) -> draft_head.DraftConfig:
    return draft_head.DraftConfig.for_target(
        target_cfg, num_layers=cfg.head.num_layers, num_taps=cfg.head.num_taps, block_size=cfg.head.block_size,
        attention=cfg.head.attention, intermediate_size=cfg.head.intermediate_size or None)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
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
    """The frozen target on the whole sequence: logits at the teacher positions and the taps."""
    b, s = tokens.shape
    cache = qwen3.new_cache(target_cfg, b, s, target_params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, taps, _ = qwen3.forward(target_params, tokens, positions, cache, target_cfg, tap_layers=tap_layers,
                                    logits_indices=teacher_pos.reshape(b, -1))
    return jax.lax.stop_gradient(logits.reshape(teacher_pos.shape + (-1,))), jax.lax.stop_gradient(taps)


def forward_and_loss(head_params, target_params, batch, *, cfg: TrainConfig, head_cfg, target_cfg, dtype):
    """Returns (loss, (student logits, teacher logits, valid)). Gradients flow to head_params only."""
    target_params = jax.lax.stop_gradient(target_params)  # the shared embedding / LM head stay frozen
    labels, valid, teacher_pos = block_targets(batch["tokens"], batch["length"], batch["anchors"],
                                               batch["anchor_valid"], head_cfg.max_depth)
    teacher_logits, taps = teacher(target_params, target_cfg, batch["tokens"], teacher_pos, head_cfg.tap_layers)
    compute_params = jax.tree.map(lambda p: p.astype(dtype), head_params)
    student = draft_head.training_logits(compute_params, target_params, target_cfg, batch["tokens"], taps,
                                         batch["anchors"], head_cfg)
    loss = draft_loss(student, teacher_logits, labels, valid, kind=cfg.loss.kind,
                      temperature=cfg.loss.temperature, gamma=cfg.loss.gamma)
    return loss, (student, teacher_logits, valid)


@dataclasses.dataclass
class Trainer:
    """Holds the jitted step/eval functions and the device placement for one config and target."""

    cfg: TrainConfig
    target: Target
    mesh: jax.sharding.Mesh

    def __post_init__(self):
        self.head_cfg = head_config_for(self.cfg, self.target.cfg)
        draft_head.check_pairing(self.head_cfg, self.target.cfg)
        self.dtype = jnp.dtype(self.cfg.run.compute_dtype)
        self.optimizer = make_optimizer(self.cfg)
        specs = draft_head.param_specs(self.head_cfg)
        self.param_shardings = sharding.param_shardings(specs, self.mesh)
        self.target_params = jax.device_put(
            jax.tree.map(lambda p: p.astype(self.dtype), self.target.params),
            sharding.param_shardings(qwen3.param_specs(self.target.cfg), self.mesh))
        loss_fn = functools.partial(forward_and_loss, cfg=self.cfg, head_cfg=self.head_cfg,
                                    target_cfg=self.target.cfg, dtype=self.dtype)
        self._loss_fn = loss_fn

        def step(state, target_params, batch):
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], target_params, batch)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

        def evaluate(params, target_params, batch):
            loss, (student, teacher_logits, valid) = loss_fn(params, target_params, batch)
            per_depth, tau = acceptance_stats(student, teacher_logits, valid)
            return loss, per_depth, tau

        self._step = jax.jit(step, donate_argnums=0)
        self._evaluate = jax.jit(evaluate)

    def init_state(self, seed: int) -> dict[str, Any]:
        specs = draft_head.param_specs(self.head_cfg)
        params = jax.jit(lambda k: init_params(specs, k, jnp.float32), out_shardings=self.param_shardings)(
            jax.random.key(seed))
        return {"params": params, "opt_state": jax.jit(self.optimizer.init)(params), "step": jnp.int32(0)}

    def place_batch(self, local_batch: dict[str, np.ndarray], replicate: bool = False) -> dict[str, jax.Array]:
        """Splits the batch over the data axis (each process gives its local part); held-out batches
        of any size are replicated instead."""
        if replicate:
            return jax.device_put({k: np.asarray(v) for k, v in local_batch.items()},
                                  sharding.replicated(self.mesh))
        return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(self.mesh, np.ndim(v)),
                                                          np.asarray(v))
                for k, v in local_batch.items()}

    def train_step(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self._step(state, self.target_params, self.place_batch(batch))

    def evaluate(self, params, batches) -> dict[str, Any]:
        losses, depths, taus, weights = [], [], [], []
        with jax.set_mesh(self.mesh):
            for batch in batches:
                loss, per_depth, tau = self._evaluate(params, self.target_params,
                                                      self.place_batch(batch, replicate=True))
                losses.append(float(loss))
                depths.append(np.asarray(per_depth))
                taus.append(float(tau))
                weights.append(len(batch["tokens"]))
        w = np.asarray(weights, np.float64) / sum(weights)
        return {"eval_loss": float(np.dot(w, losses)), "eval_expected_tau": float(np.dot(w, taus)),
                "eval_accept_per_depth": [round(float(x), 4) for x in np.tensordot(w, np.stack(depths), 1)]}


class Checkpoints:
    """orbax CheckpointManager around (train state, data-iterator state, run metadata)."""

    def __init__(self, directory: str, cfg: TrainConfig, target_cfg: qwen3.Config):
        self.fingerprint = cfg.fingerprint()
        self.target = repr(target_cfg)
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.run.keep_checkpoints,
                                               save_interval_steps=cfg.run.checkpoint_every,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        meta = {"fingerprint": self.fingerprint, "target": self.target, "config": self.cfg.to_dict(),
                "step": step}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, abstract_state):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta["target"] != self.target:
            raise ValueError(f"checkpoint at step {step} in {self.manager.directory} trains a head for another "
                             f"target ({meta['target']}), not {self.target}; set run.target to that model "
                             "or use a new run.name")
        if meta["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"checkpoint at step {step} in {self.manager.directory} was made with another config "
                f"(fingerprint {meta['fingerprint']} != {self.fingerprint}); use a new run.name or run.out_dir, "
                "or restore the config it was trained with")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


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
    """The batch splits evenly over the data-parallel devices and processes (checked before the target loads)."""
    data_parallel = mesh.shape[sharding.DATA_AXIS]
    if cfg.optim.batch_size % data_parallel or cfg.optim.batch_size % jax.process_count():
        raise ValueError(f"optim.batch_size={cfg.optim.batch_size} must be a multiple of the {data_parallel} "
                         f"data-parallel devices and of {jax.process_count()} processes")


def train(cfg: TrainConfig, target: Target, records: list[dict], *, mesh=None,
          stop_after: int | None = None, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Trains (resuming from the run directory's latest checkpoint) and exports the head.
    `stop_after` ends the process early without a final save (used to test kill-and-resume)."""
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    os.makedirs(run_dir, exist_ok=True)
    mesh = sharding.make_mesh(cfg.run.mesh_model) if mesh is None else mesh
    check_batch_size(cfg, mesh)
    trainer = Trainer(cfg, target, mesh)
    global_batch = cfg.optim.batch_size
    usable = [r for r in records if len(r["prompt_ids"]) < cfg.data.seq_len - 1 and r["completion_ids"]]
    if not usable:
        raise ValueError(f"none of the {len(records)} records has a completion within data.seq_len="
                         f"{cfg.data.seq_len} tokens; raise data.seq_len")
    train_records, heldout = split_heldout(usable, cfg.data.heldout_fraction, cfg.run.seed)
    ds = training_dataset(train_records, seq_len=cfg.data.seq_len, anchors_per_seq=cfg.data.anchors_per_seq,
                          batch_size=global_batch // jax.process_count(), seed=cfg.run.seed,
                          process_index=jax.process_index(), process_count=jax.process_count())
    eval_batches = heldout_batches(heldout, seq_len=cfg.data.seq_len, anchors_per_seq=cfg.data.anchors_per_seq,
                                   batch_size=min(global_batch, max(len(heldout), 1)),
                                   num_sequences=cfg.run.eval_sequences, seed=cfg.run.seed)
    ckpt = Checkpoints(os.path.join(run_dir, "checkpoints"), cfg, target.cfg)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    state = trainer.init_state(cfg.run.seed)
    data_state = None
    start = ckpt.latest_step()
    if start is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state, data_state = ckpt.restore(start, abstract)
        truncate_metrics(metrics_path, start)
    else:
        start = 0
        write_json_atomic(os.path.join(run_dir, "config.json"), cfg.to_dict())
    batches = batch_iterator(ds, data_state)
    tokens_per_step = global_batch * cfg.data.seq_len
    bar = tqdm(total=cfg.optim.total_steps, initial=start, desc=cfg.run.name, dynamic_ncols=True)
    t_start = t_last = time.perf_counter()
    steps_since_log, last_eval, step = 0, {}, start
    while step < cfg.optim.total_steps:
        step += 1
        state, metrics = trainer.train_step(state, next(batches))
        steps_since_log += 1
        stop_early = ((cfg.run.max_minutes > 0 and time.perf_counter() - t_start > 60 * cfg.run.max_minutes)
                      or 0 < cfg.run.max_steps <= step)
        last = step == cfg.optim.total_steps or stop_early
        if step % cfg.run.log_every == 0 or last or on_step is not None:
            loss = float(metrics["loss"])  # waits for the step: the rate below is device-bound
            now = time.perf_counter()
            row = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                   "tokens_per_s": tokens_per_step * steps_since_log / max(now - t_last, 1e-9),
                   "tokens_seen": step * tokens_per_step, "train_seconds": now - t_start}
            t_last, steps_since_log = now, 0
            if eval_batches and (step % cfg.run.eval_every == 0 or last):
                last_eval = trainer.evaluate(state["params"], eval_batches)
                row.update(last_eval)
            append_jsonl(metrics_path, row)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            tau=f"{last_eval.get('eval_expected_tau', float('nan')):.2f}")
            if on_step is not None:
                on_step(step, row)
        bar.update(1)
        ckpt.save(step, state, batches.get_state())
        if stop_after is not None and step >= stop_after:
            ckpt.wait()
            ckpt.close()
            bar.close()
            return {"stopped_at": step}
        if stop_early:
            break
    ckpt.wait()
    if step not in ckpt.manager.all_steps():
        ckpt.save(step, state, batches.get_state(), force=True)
        ckpt.wait()
    ckpt.close()
    bar.close()
    summary = {"steps": step, "tokens_seen": step * tokens_per_step, "mesh": dict(mesh.shape),
               "devices": [d.device_kind for d in mesh.devices.flat],
               "train_seconds_this_run": time.perf_counter() - t_start, **last_eval}
    if cfg.run.export_head:
        params = jax.tree.map(lambda p: np.asarray(p, dtype=jnp.bfloat16), state["params"])
        save_head(cfg.run.export_head, trainer.head_cfg, params,
                  metadata={"config": json.dumps(cfg.to_dict()), "summary": json.dumps(summary),
                            "target": target.name}, target=target)
        summary["exported_head"] = cfg.run.export_head
    return summary
