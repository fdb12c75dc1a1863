"""A training campaign: the heads trained over many time-boxed runs (segments), each starting from what the
last one brought back, every segment recorded in the campaign's folder.

    python -m jetspec_jax.train.campaign --campaign train/results/smollm2-135m-general/campaign \
        --minutes 12 --out-dir runs/campaign

The folder holds `campaign.toml` (the training config and overrides, the heads it starts from, the cycle
below) and, as segments run, `segments.jsonl` (one record each: command, commit, corpus, steps, tokens,
seconds, held-out numbers per head and kind at its start and end, the heads' digests) and `segment-NNN/`
(its metrics.jsonl, data_plan.json and the manifest of a corpus it regenerated). With `heldout_answers`
set, the first segment pins its corpus's held-out answers in that file and every segment measures on them
(train/heldout.py). `--bring-back DIR` gathers in one folder what the next segment and the repository need;
with `--bring-back-every M` also every M minutes while the segment trains, so a lost machine loses no more.

Two ways to continue (campaign.toml's `cycle.mode`):
- "restart": every segment starts from the exported heads of the last (bf16 weights, what a segment brings
  back: about 19 MB a head for the embedded model's 3-layer pair) with a fresh AdamW state, warms up to
  the cycle's peak learning rate and decays by a cosine to a tenth of it over the steps planned to fill
  `--minutes` (at the last segment's measured rate), so every segment ends annealed and its heads can ship.
  Segment n regenerates its corpus with fresh samples (data.resample = n) unless `--corpus` names one; on a
  corpus earlier segments trained on, it takes the batch stream up where they stopped (data.start_step).
- "continue": one schedule over `cycle.total_steps` cut into segments: each resumes exactly from the
  checkpoint the last brought back (`--resume-from`: fp32 weights, optimizer state, data position) on the
  same corpus, as one uninterrupted run would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import time
import tomllib

from jetspec_jax.errors import DamagedFileError, InputError, OneLineErrorParser, run_command
from jetspec_jax.provenance import copy_atomic, file_sha256, git_head, write_json_atomic

from .config import REPO_ROOT, TrainConfig, load_config

SPEC_FILE = "campaign.toml"
LOG_FILE = "segments.jsonl"
CORPUS_MANIFEST = "corpus_manifest.json"  # a segment folder's copy of the manifest of the corpus it regenerated
MODES = ("restart", "continue")
TOP_LEVEL = ("config", "overrides", "heads", "heldout_answers", "cycle")
COMPILE_GUESS_S = 180.0  # --finish-within's guess at compiling a segment's programs before one has been timed
AFTER_TRAINING_S = 120.0  # kept by --finish-within for the held-out evaluations, the checkpoint and the export


@dataclasses.dataclass(frozen=True)
class Cycle:
    mode: str = "restart"
    peak_learning_rate: float = 2e-4
    warmup_steps: int = 30
    steps_per_minute: float = 150.0  # the first segment's plan; later ones use the last segment's rate
    fresh_samples: bool = True  # restart mode: segment n's corpus draws new samples (data.resample = n)
    total_steps: int = 0  # continue mode: the one schedule's length


@dataclasses.dataclass(frozen=True)
class CampaignSpec:
    directory: str
    config: str
    overrides: tuple[str, ...]
    heads: tuple[str, ...]  # exported heads the first segment starts from, one per trained head (repo-relative)
    cycle: Cycle
    # a file in the folder pinning the held-out answers every segment measures on (train/heldout.py), written
    # from the first corpus that finds it missing; "" = each segment's corpus's own
    heldout_answers: str = ""

    @property
    def heldout_path(self) -> str | None:
        return os.path.join(self.directory, self.heldout_answers) if self.heldout_answers else None

    @classmethod
    def read(cls, directory: str) -> "CampaignSpec":
        path = os.path.join(directory, SPEC_FILE)
        if not os.path.exists(path):
            raise InputError(f"no {SPEC_FILE} in {directory}: a campaign folder holds one (see "
                             "train/results/smollm2-135m-general/campaign/)")
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise DamagedFileError(path, f"not valid TOML ({e})", f"fix the file ({__name__} documents it)") from None
        known = {f.name for f in dataclasses.fields(Cycle)}
        cycle = raw.get("cycle", {})
        problems = [f"cycle.{k} is not a setting (known: {', '.join(sorted(known))})" for k in cycle if k not in known]
        problems += [f"{k} is missing" for k in ("config", "heads") if k not in raw]
        problems += [f"{k} is not a setting (known: {', '.join(TOP_LEVEL)})" for k in sorted(set(raw) - set(TOP_LEVEL))]
        if cycle.get("mode", "restart") not in MODES:
            problems.append(f"cycle.mode must be one of {MODES}, not {cycle['mode']!r}")
        if cycle.get("mode") == "continue" and cycle.get("total_steps", 0) < 1:
            problems.append("cycle.mode = \"continue\" needs cycle.total_steps (the one schedule's length)")
        if problems:
            raise InputError(f"{path}: " + "; ".join(problems))
        return cls(directory=directory, config=raw["config"], overrides=tuple(raw.get("overrides", [])),
                   heads=tuple(raw["heads"]), cycle=Cycle(**cycle), heldout_answers=raw.get("heldout_answers", ""))


def read_records(directory: str) -> list[dict]:
    path = os.path.join(directory, LOG_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured_steps_per_minute(records: list[dict], default: float) -> float:
    """The last segment's training rate (steps per minute of training time), else the spec's guess."""
    for record in reversed(records):
        if record.get("train_seconds_this_run"):
            return 60 * record["steps_this_run"] / record["train_seconds_this_run"]
    return default


def segment_overrides(spec: CampaignSpec, records: list[dict], minutes: float, out_dir: str,
                      start_heads: list[str]) -> list[str]:
    """The trainer's overrides for the next segment, after the campaign's own: where it runs, what it starts
    from and exports, its schedule and its corpus."""
    number = len(records) + 1
    cycle = spec.cycle

    def value(paths):  # a list for several heads, one path for one
        paths = list(paths)
        return json.dumps(paths) if len(paths) > 1 else paths[0]

    exports = [os.path.join(out_dir, "export", f"head-{i}") for i in range(len(start_heads))]
    # continue mode: one schedule, so every segment the same run (the checkpoint's config), the corpus carried
    name = "campaign" if cycle.mode == "continue" else f"segment-{number:03d}"
    out = [f"run.out_dir={out_dir}", f"run.name={name}", f"run.max_minutes={minutes}",
           f"head.init_from={value(start_heads)}", f"run.export_head={value(exports)}"]
    if spec.heldout_path:
        out.append(f"data.heldout_answers={pinned_copy(spec, out_dir)}")
    if cycle.mode == "continue":
        return out + [f"optim.learning_rate={cycle.peak_learning_rate}", f"optim.warmup_steps={cycle.warmup_steps}",
                      f"optim.total_steps={cycle.total_steps}"]
    steps = max(cycle.warmup_steps + 1, round(minutes * measured_steps_per_minute(records, cycle.steps_per_minute)))
    out += [f"optim.learning_rate={cycle.peak_learning_rate}", f"optim.warmup_steps={cycle.warmup_steps}",
            f"optim.total_steps={steps}"]
    if cycle.fresh_samples:
        out += [f"data.resample={number}", f"data.regen_dir=regen-draw{number}"]
    return out


def pinned_copy(spec: CampaignSpec, out_dir: str) -> str | None:
    """The segment's own copy of the pinned held-out answers, beside its run: the trainer and every bring-back
    read it there, so a campaign folder that changes while the segment runs (a working tree synced afresh)
    cannot take it away."""
    return os.path.join(out_dir, os.path.basename(spec.heldout_path)) if spec.heldout_path else None


def start_heads(spec: CampaignSpec, state: str | None) -> list[str]:
    """Where the segment starts from: the heads a previous segment brought back (`--state`: that segment's
    export folder, holding head-0, head-1, ...), else campaign.toml's `heads` (where shipped segments go)."""
    if state is None:
        return [os.path.join(REPO_ROOT, h) if not os.path.isabs(h) else h for h in spec.heads]
    found = [os.path.join(state, f"head-{i}") for i in range(len(spec.heads))]
    missing = [p for p in found if not os.path.isdir(p)]
    if missing:
        raise InputError(f"--state {state} lacks {', '.join(missing)}: give the export folder a segment brought back")
    return found


def heads_digests(paths: list[str]) -> list[str]:
    from jetspec_jax.loading.head_checkpoint import verify_head_files

    return [verify_head_files(p).weights_digest() for p in paths]


def training_minutes(minutes: float, finish_within: float | None, elapsed_s: float, records: list[dict]) -> float:
    """The training time box: `minutes`, or less where the whole segment must end within `finish_within`
    minutes of its start (a lease's end) and `elapsed_s` went on the corpus. The rest is kept for what a
    segment does besides regenerating and training (compiling, the held-out evaluations, the checkpoint and
    the export): as long as the last segment's took, else its compile time and a guess for the rest."""
    if finish_within is None:
        return minutes
    timed = [s for s in map(overhead_seconds, records) if s]
    if timed:
        kept_s = timed[-1]
    else:
        compile_s = next((r["compile_seconds"] for r in reversed(records) if r.get("compile_seconds")),
                         COMPILE_GUESS_S)
        kept_s = compile_s + AFTER_TRAINING_S
    left_s = finish_within * 60 - elapsed_s - kept_s
    if left_s < 60:
        raise InputError(f"--finish-within {finish_within:g} leaves {max(left_s, 0) / 60:.1f} minutes of training "
                         f"after {elapsed_s:.0f} s on the corpus and {kept_s:.0f} s kept for compiling, evaluating "
                         "and exporting: give a longer time box, or carry a corpus (--corpus)")
    return min(minutes, left_s / 60)


def overhead_seconds(record: dict) -> float | None:
    """A recorded segment's seconds besides regeneration and training (None before segments timed it, or
    where its record lacks one of them)."""
    parts = (record.get("segment_seconds"), record.get("regen_seconds", 0.0), record.get("train_seconds_this_run"))
    if None in parts:
        return None
    return parts[0] - parts[1] - parts[2]


def tokens_estimated(records: list[dict]) -> bool:
    """Whether the campaign's token count rests on an estimate: a segment whose records stayed behind on its
    machine has its tokens estimated (its record's `estimated` names them), and so has every later total."""
    return any({"tokens_this_run", "campaign_tokens"} & set(r.get("estimated", ())) for r in records)


def held_out(row: dict) -> dict:
    """A metrics row's held-out numbers, per head: loss, chain tau, tree-causal tau, and tau per kind."""
    by_head = row.get("eval_by_head") or ({"head": row} if "eval_loss" in row else {})
    return {name: {"loss": e["eval_loss"], "tau": e["eval_expected_tau"],
                   **({"tree_tau": e["eval_tree_expected_tau"]} if "eval_tree_expected_tau" in e else {}),
                   "tau_by_kind": {k: v["expected_tau"] for k, v in e.get("eval_by_kind", {}).items()}}
            for name, e in by_head.items()}


def run_segment(spec: CampaignSpec, *, minutes: float, out_dir: str, state: str | None = None,
                resume_from: str | None = None, corpus_dir: str | None = None, extra: list[str] = (),
                command: str | None = None, max_steps: int = 0, mesh=None, finish_within: float | None = None,
                bring_back_to: str | None = None, bring_back_every: float = 0.0) -> dict:
    """One segment: corpus (regenerated unless given), training (on `mesh`, default all devices) for `minutes`
    or what `finish_within` leaves after the corpus, export, the record appended to the campaign's log, and
    with `bring_back_to` the segment's bring-back there. With `bring_back_every` (restart mode), every that
    many minutes of training an interim bring-back replaces the folder's: the heads as they are and a record
    marked unfinished, so a machine lost mid-segment leaves what the next segment starts from. Returns the
    record."""
    from jetspec_jax.target import load_target

    from .corpus import MANIFEST_FILE, Corpus
    from .heldout import write_pinned
    from .regenerate import load_regeneration_prompts, regenerate
    from .trainer import corpus_fingerprint, train

    started = time.perf_counter()
    records = read_records(spec.directory)
    if bring_back_every and (spec.cycle.mode != "restart" or not bring_back_to):
        raise InputError("--bring-back-every needs --bring-back and cycle.mode \"restart\" (a continued segment "
                         "resumes from a checkpoint, which the interim bring-backs do not carry)")
    if bring_back_to:
        check_bring_back_folder(bring_back_to)
    if spec.cycle.mode == "continue" and records and resume_from is None:
        raise InputError("cycle.mode is \"continue\": give --resume-from, the checkpoint the last segment brought "
                         "back (or start a new campaign folder)")
    heads = start_heads(spec, state)
    pinned = pinned_copy(spec, out_dir)
    pinned_here = pinned is not None and os.path.exists(spec.heldout_path)
    if pinned_here:
        copy_atomic(spec.heldout_path, pinned)
    planned = [*spec.overrides, *segment_overrides(spec, records, minutes, out_dir, heads)]
    given = [*extra, *([f"run.max_steps={max_steps}"] if max_steps else [])]  # the caller's settings win
    cfg = load_config(spec.config, [*planned, *given])
    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    if resume_from is not None:
        bring_in_checkpoint(resume_from, os.path.join(run_dir, "checkpoints"))
    target = load_target(cfg.run.target or None, dtype=cfg.run.compute_dtype)
    regen_seconds = 0.0
    if corpus_dir is None:
        corpus_dir = os.path.join(cfg.run.out_dir, cfg.data.regen_dir)
        prompts = load_regeneration_prompts(cfg.data.data_dir, cfg.data.sources, cfg.run.seed)
        t0 = time.perf_counter()
        # not beside the training programs' compilation: sharing the host, regeneration ran at a third of its
        # rate on the GPU (docs/training.md)
        manifest = regenerate(target, prompts, corpus_dir, cfg.data, seed=cfg.run.seed, config_name=spec.config)
        regen_seconds = time.perf_counter() - t0
        if not manifest["complete"]:
            raise InputError(f"the corpus in {corpus_dir} is unfinished (data.regen_max_minutes): run again to "
                             "resume it")
    corpus = Corpus(corpus_dir)
    if pinned is not None and not pinned_here:  # the campaign's first pinned corpus
        write_pinned(pinned, corpus, cfg.run.eval_answers_per_kind)
    if finish_within is not None:  # the schedule planned for the training time the corpus left
        minutes = training_minutes(minutes, finish_within, time.perf_counter() - started, records)
        planned = [*spec.overrides, *segment_overrides(spec, records, minutes, out_dir, heads)]
        cfg = load_config(spec.config, [*planned, *given])
    if spec.cycle.mode == "restart":
        seen = steps_on_corpus(spec.directory, records, corpus_fingerprint(corpus))
        if seen:  # a corpus earlier segments trained on: go on in its stream where they stopped
            cfg = load_config(spec.config, [*planned, f"data.start_step={seen}", *given])
    digests_before = heads_digests(heads)
    command = command or "python -m jetspec_jax.train.campaign " + shlex.join(sys.argv[1:])
    regenerated = os.path.join(corpus.out_dir, MANIFEST_FILE) if regen_seconds else None

    def interim_bring_back(progress: dict, write_heads) -> None:
        def build(folder: str) -> None:
            exports = [os.path.join(folder, "export", f"head-{i}") for i in range(len(heads))]
            write_heads(exports)
            record = segment_record(spec, records, cfg, progress, run_dir, corpus, regen_seconds, digests_before,
                                    resume_from, command, pinned, exports)
            record.update(unfinished=True, held_out_end=None)  # the last evaluation may be from an earlier step
            copy_records(os.path.join(folder, "records"), records, record, run_dir, regenerated, pinned)
        try:
            replace_folder(bring_back_to, build)
        except OSError as e:  # a safety copy that failed must not end the training it guards
            print(f"warning: the interim bring-back to {bring_back_to} failed ({e}); training goes on",
                  file=sys.stderr, flush=True)

    summary = train(cfg, target, corpus, mesh=mesh, snapshot_minutes=bring_back_every,
                    on_snapshot=interim_bring_back if bring_back_every else None)
    record = segment_record(spec, records, cfg, summary, run_dir, corpus, regen_seconds, digests_before,
                            resume_from, command, pinned)
    record["segment_seconds"] = round(time.perf_counter() - started, 1)  # the whole segment, export included
    if pinned is not None and not os.path.exists(spec.heldout_path):
        copy_atomic(pinned, spec.heldout_path)
    append_record(spec.directory, record, run_dir, regenerated)
    if bring_back_to:
        bring_back(spec, out_dir, bring_back_to, records, record, run_dir, regenerated, pinned)
    return record


def steps_on_corpus(directory: str, records: list[dict], fingerprint: str) -> int:
    """Training steps the campaign's segments have taken on the corpus with this fingerprint (each segment's
    data_plan.json names its corpus)."""
    steps = 0
    for record in records:
        plan = os.path.join(segment_folder(directory, record["segment"]), "data_plan.json")
        if os.path.exists(plan):
            with open(plan) as f:
                if json.load(f).get("corpus") == fingerprint:
                    steps += record["steps_this_run"]
    return steps


def segment_record(spec, records, cfg: TrainConfig, summary: dict, run_dir: str, corpus, regen_seconds: float,
                   digests_before: list[str], resume_from: str | None, command: str, pinned: str | None,
                   exports: list[str] | None = None) -> dict:
    """The segment's line in the log; it measured on the held-out answers at `pinned` (its copy), its heads
    after are those at `exports` (default: run.export_head)."""
    from .trainer import corpus_fingerprint

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    start_row = next((r for r in rows if r.get("step") == 0 and "warm_start" in r), None)
    evals = [r for r in rows if "eval_loss" in r or "eval_by_head" in r]
    if exports is None:
        exports = list(cfg.run.export_head) if isinstance(cfg.run.export_head, list) else [cfg.run.export_head]
    return {
        "segment": len(records) + 1, "mode": spec.cycle.mode, "commit": git_head(), "command": command,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "devices": summary.get("devices"),
        "resumed_from_checkpoint": resume_from is not None,
        "training_minutes": cfg.run.max_minutes,
        "learning_rate": cfg.optim.learning_rate, "warmup_steps": cfg.optim.warmup_steps,
        "planned_steps": cfg.optim.total_steps, "steps": summary["steps"], "steps_this_run": summary["steps_this_run"],
        "tokens_this_run": summary["tokens_seen_this_run"],
        "campaign_tokens": sum(r["tokens_this_run"] for r in records) + summary["tokens_seen_this_run"],
        "train_seconds_this_run": summary["train_seconds_this_run"],
        "tokens_per_s": round(summary["tokens_seen_this_run"] / max(summary["train_seconds_this_run"], 1e-9), 1),
        "compile_seconds": summary["compile_seconds_this_run"], "regen_seconds": round(regen_seconds, 1),
        "corpus": {"dir": os.path.basename(os.path.normpath(corpus.out_dir)),
                   "answers": corpus.manifest.get("num_answers"),
                   "resample": corpus.manifest.get("settings", {}).get("resample", 0),
                   "regen_fraction": corpus.manifest.get("settings", {}).get("regen_fraction", 1.0),
                   "fingerprint": corpus_fingerprint(corpus), "start_step": cfg.data.start_step},
        "heldout": {"file": spec.heldout_answers, "sha256": file_sha256(pinned)} if pinned else None,
        "heads_before": digests_before, "heads_after": heads_digests(exports) if all(exports) else None,
        "held_out_start": held_out(start_row) if start_row else None,
        "held_out_end": held_out(evals[-1]) if evals else None,
        **({"estimated": ["campaign_tokens"]} if tokens_estimated(records) else {}),
    }


def segment_folder(directory: str, segment: int) -> str:
    return os.path.join(directory, f"segment-{segment:03d}")


def append_record(directory: str, record: dict, run_dir: str, corpus_manifest: str | None = None) -> None:
    """The segment's metrics, data plan and (when it regenerated one) its corpus's manifest into segment-NNN/,
    then its line in the log (last, so a log line always has its folder)."""
    write_segment_folder(segment_folder(directory, record["segment"]), record, run_dir, corpus_manifest)
    with open(os.path.join(directory, LOG_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


def write_segment_folder(folder: str, record: dict, run_dir: str, corpus_manifest: str | None) -> None:
    os.makedirs(folder, exist_ok=True)
    copies = {name: os.path.join(run_dir, name) for name in ("metrics.jsonl", "data_plan.json")}
    if corpus_manifest:
        copies[CORPUS_MANIFEST] = corpus_manifest
    for name, source in copies.items():
        if os.path.exists(source):
            copy_atomic(source, os.path.join(folder, name))
    write_json_atomic(os.path.join(folder, "segment.json"), record)


def bring_in_checkpoint(source: str, checkpoints: str) -> None:
    """A checkpoint a segment brought back (a step folder of orbax's, or the folder holding it) placed where
    the trainer resumes from."""
    step_dir = source if os.path.basename(os.path.normpath(source)).isdigit() else None
    if step_dir is None:
        steps = sorted((d for d in os.listdir(source) if d.isdigit()), key=int) if os.path.isdir(source) else []
        if not steps:
            raise InputError(f"--resume-from {source} holds no checkpoint step folder: give the checkpoint a "
                             "segment brought back (its run's checkpoints/ or one step inside it)")
        step_dir = os.path.join(source, steps[-1])
    os.makedirs(checkpoints, exist_ok=True)
    target = os.path.join(checkpoints, os.path.basename(os.path.normpath(step_dir)))
    if not os.path.exists(target):
        shutil.copytree(step_dir, target)


def bring_back(spec: CampaignSpec, out_dir: str, destination: str, earlier: list[dict], record: dict, run_dir: str,
               corpus_manifest: str | None, pinned: str | None) -> None:
    """What the next segment starts from and what the repository records, copied out of a finished segment's
    run: the exported heads (`--state DESTINATION/export`), in continue mode the last checkpoint
    (`--resume-from DESTINATION/checkpoint`), and `records/` (copy_records) to copy over the campaign folder.
    It replaces what `destination` held (an unfinished segment's bring-back) whole."""
    check_bring_back_folder(destination)

    def build(folder: str) -> None:
        shutil.copytree(os.path.join(out_dir, "export"), os.path.join(folder, "export"))
        if spec.cycle.mode == "continue":
            step = latest_checkpoint(os.path.join(out_dir, "campaign"))
            if step is None:
                raise InputError(f"no checkpoint in {out_dir}/campaign/checkpoints to bring back")
            shutil.copytree(step, os.path.join(folder, "checkpoint", os.path.basename(step)))
        copy_records(os.path.join(folder, "records"), earlier, record, run_dir, corpus_manifest, pinned)
    replace_folder(destination, build)


def copy_records(records: str, earlier: list[dict], record: dict, run_dir: str, corpus_manifest: str | None,
                 pinned: str | None) -> None:
    """A segment's `records/`, made from its run alone (never re-read from the campaign folder, which may have
    changed meanwhile): the log of the `earlier` segments with its line added, its segment-NNN/ folder, the
    pinned held-out answers it measured on."""
    write_segment_folder(segment_folder(records, record["segment"]), record, run_dir, corpus_manifest)
    with open(os.path.join(records, LOG_FILE), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in [*earlier, record])
    if pinned is not None:
        shutil.copyfile(pinned, os.path.join(records, os.path.basename(pinned)))


BRING_BACK_ENTRIES = {"export", "checkpoint", "records"}


def check_bring_back_folder(path: str) -> None:
    """A bring-back replaces its folder whole: refuse one that holds anything a bring-back does not."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"--bring-back {path} is a file: give a new or empty folder")
    other = sorted(set(os.listdir(path)) - BRING_BACK_ENTRIES) if os.path.isdir(path) else []
    if other:
        raise InputError(f"--bring-back {path} holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, "
                         "which a bring-back would replace: give a new or empty folder, or one a segment brought "
                         "back into")


def replace_folder(destination: str, build) -> None:
    """`build(folder)` fills a folder beside `destination`, which then takes its place: a copy taken at any
    moment holds the old bring-back or the new one whole (between the two renames, DESTINATION.old)."""
    destination = os.path.normpath(destination)
    partial, old = destination + ".partial", destination + ".old"
    for leftover in (partial, old):
        shutil.rmtree(leftover, ignore_errors=True)
    os.makedirs(partial)
    build(partial)
    if os.path.exists(destination):
        os.rename(destination, old)
    os.rename(partial, destination)
    shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str) -> str | None:
    folder = os.path.join(run_dir, "checkpoints")
    steps = sorted((d for d in os.listdir(folder) if d.isdigit()), key=int) if os.path.isdir(folder) else []
    return os.path.join(folder, steps[-1]) if steps else None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.train.campaign", description=__doc__.split("\n\n")[0])
    p.add_argument("--campaign", required=True, help="the campaign folder (holding campaign.toml)")
    p.add_argument("--minutes", type=float, required=True, help="this segment's training time box")
    p.add_argument("--out-dir", required=True, help="where the segment runs: corpus, checkpoints, exported heads")
    p.add_argument("--state", default=None, help="restart mode: the export folder a previous segment brought back "
                                                 "(default: campaign.toml's heads)")
    p.add_argument("--finish-within", type=float, default=None, metavar="MINUTES",
                   help="end the whole segment (corpus, compilation, training, evaluation, export) within this many "
                        "minutes of its start, e.g. a lease's end: training gets --minutes or what the corpus left")
    p.add_argument("--resume-from", default=None, help="continue mode: the checkpoint the last segment brought back")
    p.add_argument("--corpus", default=None, help="a regenerated corpus to train on instead of regenerating")
    p.add_argument("--bring-back", default=None, help="copy what the next segment needs here: export/ (the heads), "
                                                       "in continue mode checkpoint/ (the last step's state), and "
                                                       "records/ (the segment's log line and folder)")
    p.add_argument("--bring-back-every", type=float, default=0.0, metavar="MINUTES",
                   help="restart mode: every this many minutes of training, replace --bring-back's folder with the "
                        "heads as they are and the segment's record so far (marked unfinished), so a machine lost "
                        "mid-segment still leaves what the next segment starts from")
    p.add_argument("overrides", nargs="*", help="section.key=value after the campaign's, e.g. data.data_dir=DIR")
    return p


def campaign_command(argv=None) -> int:
    args = build_parser().parse_args(argv)
    spec = CampaignSpec.read(args.campaign)
    record = run_segment(spec, minutes=args.minutes, out_dir=args.out_dir, state=args.state,
                         resume_from=args.resume_from, corpus_dir=args.corpus, extra=args.overrides,
                         finish_within=args.finish_within, bring_back_to=args.bring_back,
                         bring_back_every=args.bring_back_every)
    print(json.dumps(record, indent=2))
    return 0


def main(argv=None) -> int:
    return run_command(campaign_command, argv)


if __name__ == "__main__":
    sys.exit(main())
