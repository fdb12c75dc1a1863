"""Turns results files into report.md (tables per benchmark, method, budget, temperature, head set and
batch size), report.json and speedup/tau-vs-budget plots."""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from typing import Any

from jetspec_jax.provenance import write_json_atomic

from .datasets import BENCHMARKS
from .records import SETTINGS_BEFORE_RECORDED, label_heads, line_key, read_lines, read_meta

log = logging.getLogger(__name__)

METHOD_ORDER = ("ar", "dflash", "ddtree", "jetspec", "jetspec-tc")
LOSSLESS_NOTE = ("At temperature 0 every speculative method must reproduce AR's tokens exactly, and in fp32 "
                 "the count must be 0. In bf16 a tree verify pass rounds differently from a one-token step "
                 "(other matmul shapes, other reduction orders), so wherever the target's top two logits are "
                 "within bf16's rounding the argmax can flip, and the outputs part from there on; over "
                 "hundreds of tokens most outputs meet such a near-tie. benchmarks/eval_tie_flips.py "
                 "recomputes the fp32 logits at each first mismatch to show that they are near-ties.")
DEFINITIONS = """\
- **tau**: tokens committed per target verify pass = sum(generated - 1) / sum(verify passes); the first
  token comes from the prefill.
- **decode tok/s**: (generated - 1) tokens / decode seconds, where decode seconds = the timed call minus a
  prefill-only call (max_new_tokens=1) of the same prompt and method. Device time of one jitted call,
  compile excluded; prompts run one at a time (batch 1).
- **speedup**: AR decode seconds per token / the method's, summed over the prompts both ran, against
  the AR lines of the same head set (each run measures its own AR). **e2e speedup** is the same with
  prefill included (whole call, all generated tokens).
- **accuracy**: GSM8K numeric, MATH-500 normalised LaTeX, AIME integer, HumanEval/MBPP pass@1 (tests run
  in a sandboxed subprocess); MT-Bench and the held-out benchmarks (summarise, doc_qa, translate, open_qa)
  have no reference ("-"). **= AR** (T=0): every prompt scored as AR's did.
- **prompt tokens**: per benchmark, with the chat template, over the prompts that ran.
- **mismatches (T=0)**: prompts whose tokens differ from AR's, out of those compared.
- **batched runs** (`run --batch N`; their own tables): up to N prompts of one padded width in one
  generation call. tau, acceptance, accuracy and mismatches are per prompt, as at batch 1. Their
  **throughput speedup** is batch throughput, not latency: (generated - 1) tokens / decode seconds of
  whole batches, a batch's seconds shared among its prompts, against AR run at the same batch size;
  the latency speedup is the batch-1 tables' only."""


def precision(line: dict) -> str:
    """Runs of one prompt at different precisions are different results: "bfloat16", "float32/highest"."""
    matmul = line.get("matmul_precision") or "default"
    return line["dtype"] if matmul == "default" else f"{line['dtype']}/{matmul}"


def batch(line: dict) -> int:
    """The --batch of a line's run; lines of batch-1 runs (and older files) do not record it."""
    return line.get("batch", 1)


def load_results(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(lines deduplicated by key, precision, head set and batch size, the later file winning; sidecar
    metas) of all files."""
    by_key, metas = {}, []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no results file at {path}")
        repeated = []
        for line in label_heads(read_lines(path)):
            key = line_key(line) + (precision(line), line["heads_label"], batch(line))
            if key in by_key:
                repeated.append(key)
            by_key[key] = line
        if repeated:  # a rerun archived beside the first run replaces its lines
            log.warning("%s repeats %d keys read before (first: %s); the later line of each is used", path,
                        len(repeated), repeated[0])
        meta = read_meta(path)
        if meta is not None:
            metas.append({"results": path, **meta})
    return list(by_key.values()), metas


def ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def check_one_setup(rows: list[dict], group: str) -> None:
    """A group's tau and speedup describe one draft head, one tree scoring, one GEMM backend and one draft
    attention: lines of two heads under one head-set label (files of an older and a newer head given
    together, whose later lines replace only the prompts they share), of two tree temperatures, GEMM
    backends, draft attentions or draft vocabularies are refused."""
    shas = sorted({r["head_sha256"] for r in rows if r.get("head_sha256")})
    if len(shas) > 1:
        raise ValueError(f"the results hold {len(shas)} draft heads in one group ({group}): sha256 "
                         f"{', '.join(s[:12] for s in shas)}; run each head set with its own --heads-label "
                         "to compare them, or report each head's results files separately")
    # AR and chain lines carry None, as do lines from before a setting was recorded: its default
    for field, what in (("tree_temperature", "tree temperatures"), ("gemm_backend", "GEMM backends"),
                        ("draft_attention", "draft attentions"), ("draft_vocab", "draft vocabularies")):
        values = sorted({r.get(field) or SETTINGS_BEFORE_RECORDED[field] for r in rows}, key=str)
        if len(values) > 1:
            raise ValueError(f"the results hold {what} {', '.join(map(str, values))} in one group ({group}); "
                             "report the results files of each separately")


def head_sets(lines: list[dict]) -> list[str]:
    """The head-set labels of the lines, in the order their files were given."""
    return list(dict.fromkeys(line["heads_label"] for line in label_heads(lines)))


def baseline_key(line: dict) -> tuple:
    """The AR line a run is timed and scored against: the same prompt, temperature, precision, head set
    and batch size, that is AR as measured in the same run."""
    return line["benchmark"], line["id"], line["temperature"], precision(line), line["heads_label"], batch(line)


def group_metrics(lines: list[dict]) -> list[dict[str, Any]]:
    """One dict per (benchmark, method, budget, temperature, precision, head set, batch size), ordered for
    reading. Each head set's run measured its own AR, so a method's speedup is against the AR of its head
    set (and batch size)."""
    valid = [line for line in label_heads(lines) if "error" not in line]
    ar = {baseline_key(r): r for r in valid if r["method"] == "ar"}
    groups = defaultdict(list)
    for r in valid:
        key = (r["benchmark"], r["method"], r["budget"], r["temperature"], precision(r), r["heads_label"],
               batch(r))
        groups[key].append(r)
    out = []
    for (bench, method, budget, temp, prec, label, size), rows in groups.items():
        check_one_setup(rows, f"{bench} {method} B={budget} T={temp} {prec}, head set {label}"
                              + (f", batch {size}" if size > 1 else ""))
        decoded = sum(map(decoded_tokens, rows))
        paired = [(r, ar[baseline_key(r)]) for r in rows if baseline_key(r) in ar]
        scored = [r["correct"] for r in rows if r.get("correct") is not None]
        compared = [r["matches_ar"] for r in rows if r.get("matches_ar") is not None]
        forwards = sum(r["target_forwards"] or 0 for r in rows)
        prompts = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens") is not None]
        out.append({
            "benchmark": bench, "method": method, "budget": budget, "temperature": temp, "precision": prec,
            "heads_label": label, "batch": size, "n": len(rows),
            "tau": ratio(decoded, forwards) if method != "ar" else None,
            "decode_tokens_per_second": ratio(decoded, sum(map(decode_seconds, rows))),
            **speedups(paired, size),
            "mean_generated": sum(r["num_generated"] for r in rows) / len(rows),
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
            "max_prompt_tokens": max(prompts, default=None),
            "accuracy": sum(scored) / len(scored) if scored else None,
            "accuracy_same_as_ar": (all(r.get("correct") == a.get("correct") for r, a in paired)
                                    if method != "ar" and temp == 0 and paired and scored else None),
            "mismatches": compared.count(False) if compared else None, "compared": len(compared),
            "accept_histogram": accept_histogram(rows),
            "dtype": sorted({r["dtype"] for r in rows}),
            "matmul_precision": sorted({r.get("matmul_precision") or "default" for r in rows}),
            "heads": sorted({(r["head"], r["head_sha256"]) for r in rows if r["head"]}, key=str),
        })
    labels = head_sets(valid)
    return sorted(out, key=lambda g: reading_order(g) + (labels.index(g["heads_label"]),))


def reading_order(group: dict) -> tuple:
    benchmarks = list(BENCHMARKS)
    bench = benchmarks.index(group["benchmark"]) if group["benchmark"] in benchmarks else len(benchmarks)
    method = method_order(group["method"])
    return (bench, group["benchmark"], group["precision"], group["batch"], group["temperature"], method,
            group["budget"] or 0)


def method_order(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def decoded_tokens(line: dict) -> int:
    return max(line["num_generated"] - 1, 0)


def generated_tokens(line: dict) -> int:
    return line["num_generated"]


def decode_seconds(line: dict) -> float:
    """The line's decode seconds; a batched line's share of its batch's, so that the lines of a batch
    add up to the batch's."""
    return line["decode_seconds"] if batch(line) == 1 else line["batch_decode_seconds"] / line["batch_size"]


def call_seconds(line: dict) -> float:
    """The line's whole generation call, prefill included (a batched line: its share)."""
    return line["total_seconds"] if batch(line) == 1 else line["batch_seconds"] / line["batch_size"]


def per_token_ratio(paired: list[tuple[dict, dict]], seconds, tokens) -> float | None:
    """(AR seconds per token) / (method seconds per token) over prompts that both ran."""
    ar_per_token = ratio(sum(seconds(a) for _, a in paired), sum(tokens(a) for _, a in paired))
    method_per_token = ratio(sum(seconds(r) for r, _ in paired), sum(tokens(r) for r, _ in paired))
    if not ar_per_token or not method_per_token:
        return None
    return ar_per_token / method_per_token


def speedups(paired: list[tuple[dict, dict]], size: int) -> dict[str, float | None]:
    """Decode and end-to-end speedup against AR. At batch 1 they are latency speedups; a batched group's
    are throughput speedups and go under other names, so that no table or reader takes one for the other."""
    decode = per_token_ratio(paired, decode_seconds, decoded_tokens)
    e2e = per_token_ratio(paired, call_seconds, generated_tokens)
    if size == 1:
        return {"speedup": decode, "e2e_speedup": e2e, "throughput_speedup": None, "e2e_throughput_speedup": None}
    return {"speedup": None, "e2e_speedup": None, "throughput_speedup": decode, "e2e_throughput_speedup": e2e}


def accept_histogram(rows: list[dict]) -> list[float] | None:
    """Share of verify passes that accepted k = 0, 1, .. drafts."""
    counts = [r["accept_counts"] for r in rows if r.get("accept_counts")]
    if not counts:
        return None
    total = [sum(c[k] if k < len(c) else 0 for c in counts) for k in range(max(map(len, counts)))]
    return [t / sum(total) for t in total] if sum(total) else None


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def method_label(g: dict) -> str:
    label = g["method"] if g["budget"] is None else f"{g['method']} B={g['budget']}"
    return label if g["batch"] == 1 else f"{label} batch {g['batch']}"


def speed_field(size: int) -> str:
    """The group field a table of batch-`size` runs shows as their speedup (see `speedups`)."""
    return "speedup" if size == 1 else "throughput_speedup"


def main_precision(groups: list[dict]) -> str:
    """The precision most runs used: the summary table and the plots show it."""
    return Counter(g["precision"] for g in groups for _ in range(g["n"])).most_common(1)[0][0]


def heads_column(labels: list[str]):
    """(header cell, separator cell, a group's cell) of a table's head-set column, which a report of
    one head set leaves out."""
    if len(labels) < 2:
        return "", "", lambda g: ""
    return "heads | ", "---|", lambda g: f"{g['heads_label']} | "


def summary_table(groups: list[dict], labels: list[str], speed: str = "speedup") -> list[str]:
    """Paper layout: rows (T, method, budget, head set), columns benchmarks, cells speedup/tau (`speed`:
    the group field shown as speedup; groups of one batch size)."""
    benches = list(dict.fromkeys(g["benchmark"] for g in groups))
    head, sep, cell = heads_column(labels)
    rows = defaultdict(dict)
    for g in groups:
        if g["method"] != "ar":
            row = (g["temperature"], method_order(g["method"]), g["budget"], g["method"],
                   labels.index(g["heads_label"]))
            rows[row][g["benchmark"]] = g
    out = ["| T | method | B | " + head + " | ".join(benches) + " |",
           "|---|---|---|" + sep + "---|" * len(benches)]
    for (temp, _, budget, method, _), cells in sorted(rows.items()):
        texts = [f"{fmt(cells[b][speed])}/{fmt(cells[b]['tau'])}" if b in cells else "" for b in benches]
        out.append(f"| {temp:g} | {method} | {budget} | " + cell(next(iter(cells.values())))
                   + " | ".join(texts) + " |")
    return out


def side_by_side(rows: list[dict], labels: list[str], speed: str = "speedup") -> list[str]:
    """One benchmark's tau and speedup (`speed`) of each head set next to each other, per (precision, T,
    method, budget) that two or more head sets ran, with each head set's difference from the first one;
    `rows` are of one batch size."""
    runs = defaultdict(dict)
    for g in rows:
        if g["method"] != "ar":
            runs[(g["precision"], g["temperature"], method_order(g["method"]), g["budget"] or 0,
                  method_label(g))][g["heads_label"]] = g
    runs = {key: by_label for key, by_label in sorted(runs.items()) if len(by_label) > 1}
    if not runs:
        return []
    shown = [label for label in labels if any(label in by_label for by_label in runs.values())]
    first, others = shown[0], shown[1:]
    precisions = len({key[0] for key in runs}) > 1
    columns = ["method"] + ["precision"] * precisions + ["T"]
    fields = ("tau", speed)
    for field in fields:
        name = field.replace("_", " ")
        columns += [f"{name} {label}" for label in shown] + [f"Δ {name} {label}" for label in others]
    out = ["", f"Head sets side by side (Δ: each head set minus {first}; each speedup is against the AR "
           "of its own run):", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for (prec, temp, _, _, label), by_label in runs.items():
        cells = [label] + [prec] * precisions + [f"{temp:g}"]
        for field in fields:
            values = {label: by_label[label][field] if label in by_label else None for label in shown}
            cells += [fmt(values[label]) for label in shown]
            cells += [f"{values[label] - values[first]:+.2f}" if None not in (values[label], values[first])
                      else "-" for label in others]
        out.append("| " + " | ".join(cells) + " |")
    return out


def batch_sizes(groups: list[dict]) -> list[int]:
    return sorted({g["batch"] for g in groups})


def metrics_table(rows: list[dict], labels: list[str]) -> list[str]:
    """A benchmark's groups of one batch size: batch 1 with its latency speedups, a batched size with
    its throughput speedups, each column named for what it holds."""
    head, sep, cell = heads_column(labels)
    size = rows[0]["batch"]
    speed = ("speedup | e2e speedup" if size == 1 else
             f"throughput speedup (batch {size}) | e2e throughput speedup (batch {size})")
    tok_s = "decode tok/s" if size == 1 else f"batch {size} decode tok/s"
    out = [f"| method | {head}precision | T | n | tau | {tok_s} | {speed} | accuracy | = AR | mismatches (T=0) |",
           "|---|" + sep + "---|---|---|---|---|---|---|---|---|---|"]
    for g in rows:
        mism = f"{g['mismatches']}/{g['compared']}" if g["mismatches"] is not None else "-"
        decode, e2e = g[speed_field(size)], g["e2e_" + speed_field(size)]
        out.append(f"| {method_label(g)} | {cell(g)}{g['precision']} | {g['temperature']:g} | {g['n']} | "
                   f"{fmt(g['tau'])} | {fmt(g['decode_tokens_per_second'], 1)} | {fmt(decode)} | {fmt(e2e)} | "
                   f"{fmt(g['accuracy'], 3)} | {fmt(g['accuracy_same_as_ar'])} | {mism} |")
    return out + side_by_side(rows, labels, speed_field(size))


def benchmark_tables(groups: list[dict], labels: list[str]) -> list[str]:
    head, sep, cell = heads_column(labels)
    out = []
    for bench in dict.fromkeys(g["benchmark"] for g in groups):
        rows = [g for g in groups if g["benchmark"] == bench]
        out += [f"### {bench}", ""]
        sized = next((g for g in rows if g["mean_prompt_tokens"] is not None), None)
        if sized:  # results files from before prompt_tokens was recorded have none
            out += [f"Prompt tokens: mean {sized['mean_prompt_tokens']:.0f}, max {sized['max_prompt_tokens']} "
                    f"({method_label(sized)}, n={sized['n']}).", ""]
        for size in batch_sizes(rows):
            if size > 1:
                out += ["", f"Batch {size} (up to {size} prompts per call; speedups are throughput against AR "
                        f"at batch {size}, not latency):", ""]
            out += metrics_table([g for g in rows if g["batch"] == size], labels)
        hist = [g for g in rows if g["accept_histogram"]]
        if hist:
            width = 1 + max(k for g in hist for k, share in enumerate(g["accept_histogram"]) if share > 0)
            out += ["", "Acceptance per verify pass (% of passes that accepted k drafts):", "",
                    f"| method | {head}precision | T | " + " | ".join(f"k={k}" for k in range(width)) + " |",
                    "|---|" + sep + "---|---|" + "---|" * width]
            for g in hist:
                shares = (g["accept_histogram"] + [0.0] * width)[:width]
                out.append(f"| {method_label(g)} | {cell(g)}{g['precision']} | {g['temperature']:g} | "
                           + " | ".join(f"{100 * s:.0f}" for s in shares) + " |")
        out.append("")
    return out


def header(paths: list[str], metas: list[dict], groups: list[dict], labels: list[str]) -> list[str]:
    out = ["# JetSpec evaluation report", "", f"Results: {', '.join(paths)}", ""]
    for meta in metas:
        settings = {**SETTINGS_BEFORE_RECORDED, **meta.get("settings", {})}
        out.append(f"- `{meta['results']}`: target {settings.get('target')}, {settings.get('dtype')} "
                   f"(matmul precision {settings.get('matmul_precision')}), "
                   f"max_new_tokens {settings.get('max_new_tokens')}, width {settings.get('width')}, "
                   f"tree temperature {settings['tree_temperature']}, GEMM backend {settings['gemm_backend']}, "
                   f"draft attention {settings['draft_attention']}, seed {settings.get('seed')}"
                   + (f", head set {settings['heads_label']}" if "heads_label" in settings else "")
                   + (f", batch {settings['batch']}" if settings["batch"] > 1 else ""))
        for run in meta.get("runs", []):
            env = run["environment"]
            devices = ", ".join(f"{n}x {kind}" for kind, n in Counter(env.get("devices", [])).items())
            out.append(f"  - `{run['command']}` ({env.get('date_utc')}; {env.get('backend')}: {devices}; "
                       f"{env.get('platform')}; python {env.get('python')}, jax {env.get('jax')}, "
                       f"flax {env.get('flax')}, transformers {env.get('transformers')}; "
                       f"commit {env.get('git_commit')})")
    heads = sorted({(g["heads_label"], *h) for g in groups for h in g["heads"]},
                   key=lambda h: (labels.index(h[0]), str(h[1:])))
    out += ["", "Draft heads by head set (sha256 of head.safetensors, or for sharded weights a digest of the "
            "shards' sha256):", ""]
    out += [f"- {label}: {name}, " + (f"`{sha}`" if sha else "random initialisation, no weights file")
            for label, name, sha in heads] or ["- none"]
    return out + [""]


def lossless_lines(groups: list[dict]) -> list[str]:
    fp32 = [g for g in groups if g["precision"].split("/")[0] == "float32" and g["mismatches"]]
    exact = sum(g["mismatches"] for g in fp32 if g["precision"] == "float32/highest")
    out = [LOSSLESS_NOTE, ""]
    for prec, size in sorted({(g["precision"], g["batch"]) for g in groups}):
        of = [g for g in groups if (g["precision"], g["batch"]) == (prec, size)]
        out.append(f"- {prec}" + (f", batch {size}" if size > 1 else "")
                   + f": {sum(g['mismatches'] or 0 for g in of)} mismatched prompts at T=0 "
                   f"(of {sum(g['compared'] for g in of)} compared).")
    if exact:
        out.append(f"**{exact} mismatches in fp32 with full-precision matmuls: speculative decoding is "
                   "not exact here; this is a bug.**")
    if sum(g["mismatches"] for g in fp32) > exact:
        out.append("Some fp32 mismatches ran with reduced-precision (e.g. TF32) matmuls, which round like "
                   "bf16; rerun them (fp32 runs now compute every dot in fp32) to check exactness.")
    return out + [""]


def failed_by_benchmark(errors: list[dict]) -> dict[str, list[dict]]:
    by_benchmark = defaultdict(list)
    for line in errors:
        by_benchmark[line["benchmark"]].append(line)
    return dict(by_benchmark)


def failed_runs(errors: list[dict]) -> list[str]:
    """Runs recorded with an `error` (a prompt too long for the target's positions): per benchmark,
    how many, which prompts and one reason."""
    if not errors:
        return []
    out = [f"{len(errors)} runs failed and are left out (see their `error` field):", ""]
    for bench, rows in failed_by_benchmark(errors).items():
        ids = list(dict.fromkeys(r["id"] for r in rows))
        shown = ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
        out.append(f"- {bench}: {len(rows)} runs of {len(ids)} prompts ({shown}); e.g. {rows[0]['error']}")
    return out + [""]


HEAD_SET_MARKERS = "osD^v<>ph"


def plot_vs_budget(groups: list[dict], labels: list[str], field: str, ylabel: str, path: str) -> None:
    """One panel per benchmark, one colour per method, solid T=0 and dashed T>0, one marker per head set
    (the first filled, the others hollow); dflash is one point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(g["benchmark"] for g in groups))
    cols = min(3, len(benches))
    rows = -(-len(benches) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax, bench in zip(axes.flat, benches):
        series = defaultdict(list)
        for g in groups:
            if g["benchmark"] == bench and g["method"] != "ar" and g[field] is not None:
                series[(g["method"], g["temperature"], labels.index(g["heads_label"]))].append(
                    (g["budget"], g[field]))
        for (method, temp, head_set), points in sorted(series.items()):
            points.sort()
            color = f"C{METHOD_ORDER.index(method)}" if method in METHOD_ORDER else None
            name = f"{method} T={temp:g}" + (f" {labels[head_set]}" if len(labels) > 1 else "")
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color,
                    marker=HEAD_SET_MARKERS[head_set % len(HEAD_SET_MARKERS)],
                    markerfacecolor=None if head_set == 0 else "none",
                    linestyle="-" if temp == 0 else "--", label=name)
        if field.endswith("speedup"):
            ax.axhline(1.0, color="gray", linewidth=0.8)
        budgets = sorted({p[0] for points in series.values() for p in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_title(bench)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(benches):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(paths: list[str], out_dir: str) -> list[str]:
    """Writes report.md, report.json, speedup_vs_budget.png and tau_vs_budget.png; returns their paths."""
    lines, metas = load_results(paths)
    groups, labels = group_metrics(lines), head_sets(lines)
    if not groups:
        raise ValueError(f"no usable result lines in {', '.join(paths)}")
    os.makedirs(out_dir, exist_ok=True)
    main = main_precision(groups)
    headline = [g for g in groups if g["precision"] == main]
    plotted = batch_sizes(headline)[0]  # batch 1 where the results have it: the latency speedup
    shown = [g for g in headline if g["batch"] == plotted]
    speed_label = (f"decode speedup vs AR ({main})" if plotted == 1 else
                   f"decode throughput speedup vs AR, batch {plotted} ({main})")
    plots = {speed_field(plotted): ("speedup_vs_budget.png", speed_label),
             "tau": ("tau_vs_budget.png", f"tau ({main}" + (f", batch {plotted})" if plotted > 1 else ")"))}
    try:
        import matplotlib  # noqa: F401  (the plots are optional: the tables are the report)
    except ImportError:
        log.warning("matplotlib is not installed, so the report has no plots: pip install -e \".[eval]\"")
        plots = {}
    for field, (name, ylabel) in plots.items():
        plot_vs_budget(shown, labels, field, ylabel, os.path.join(out_dir, name))
    errors = [line for line in lines if "error" in line]
    md = header(paths, metas, groups, labels)
    md += ["## Definitions", "", DEFINITIONS, "", "## Lossless check", ""] + lossless_lines(groups)
    md += failed_runs(errors)
    others = sorted({g["precision"] for g in groups} - {main})
    elsewhere = f"; {', '.join(others)} in the per-benchmark tables" if others else ""
    for size in batch_sizes(headline):
        title = (f"## Summary: speedup/tau ({main}{elsewhere})" if size == 1 else
                 f"## Summary, batch {size}: throughput speedup/tau ({main}; throughput against AR at batch "
                 f"{size}, not latency)")
        md += [title, ""] + summary_table([g for g in headline if g["batch"] == size], labels, speed_field(size))
        md += [""]
    md += ["## Per benchmark", ""] + benchmark_tables(groups, labels)
    if plots:
        md += ["## Plots", ""] + [f"![{field}]({name})" for field, (name, _) in plots.items()] + [""]
    md_path, json_path = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.json")
    tmp = md_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    os.replace(tmp, md_path)
    failed_prompts = {bench: list(dict.fromkeys(r["id"] for r in rows))
                      for bench, rows in failed_by_benchmark(errors).items()}
    write_json_atomic(json_path, {"sources": paths, "runs": metas, "head_sets": labels, "groups": groups,
                                  "failed_runs": len(errors), "failed_prompts": failed_prompts})
    return [md_path, json_path] + [os.path.join(out_dir, name) for name, _ in plots.values()]
