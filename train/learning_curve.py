"""A campaign's learning curve: held-out loss and teacher-forced tau per head and kind of prompt against the
real tokens the campaign has trained, read from its segments.jsonl, written beside it as a table
(learning_curve.md), numbers (learning_curve.json) and a plot (learning_curve.png).

    python -m jetspec_jax.train.learning_curve train/results/smollm2-135m-general/campaign
"""

from __future__ import annotations

import io
import itertools
import os
import sys

from jetspec_jax.errors import InputError, OneLineErrorParser, run_command
from jetspec_jax.provenance import write_bytes_atomic, write_json_atomic

from .campaign import LOG_FILE, read_records, tokens_estimated

FLAT = 0.01  # a kind whose tau gained less than this share over the last segment has stopped growing


def heldout_set(record: dict) -> str:
    """What a segment's held-out numbers were measured on: its pinned file's digest, else its corpus's own
    held-out answers (before a campaign pinned them, each corpus decoded its own; records before corpus
    fingerprints count as a set each)."""
    pinned = record.get("heldout")
    if pinned:
        return f"pinned:{pinned['sha256'][:16]}"
    corpus = record.get("corpus", {})
    return f"corpus:{corpus['fingerprint']}" if corpus.get("fingerprint") else f"segment:{record['segment']}"


def curve_points(records: list[dict]) -> dict[str, list[dict]]:
    """Per head: the first segment's start (0 tokens), then every segment's end at the campaign's tokens. A
    segment measured on other held-out answers than the one before also gives its start, so that each step of
    the curve compares numbers of one held-out set (`heldout` names it)."""
    if not records:
        raise InputError(f"no segment recorded yet ({LOG_FILE} is empty or missing): run a segment first")
    curves: dict[str, list[dict]] = {}
    before = None  # the held-out set of the last point
    estimated = False  # whether the campaign's total so far includes a segment's estimated tokens
    for record in records:
        held = heldout_set(record)
        if held != before:
            for head, numbers in (record.get("held_out_start") or {}).items():
                curves.setdefault(head, []).append({"segment": record["segment"] - 1,
                                                    "tokens": record["campaign_tokens"] - record["tokens_this_run"],
                                                    "tokens_estimated": estimated, "heldout": held, **numbers})
        estimated = estimated or tokens_estimated([record])
        for head, numbers in (record.get("held_out_end") or {}).items():
            curves.setdefault(head, []).append({"segment": record["segment"], "tokens": record["campaign_tokens"],
                                                "tokens_estimated": estimated, "heldout": held, **numbers})
        before = held
    return curves


def growth(points: list[dict]) -> dict[str, float]:
    """Each kind's relative tau gain over the last segment (and "all" for the pooled tau), on its held-out set."""
    if len(points) < 2 or points[-2]["heldout"] != points[-1]["heldout"]:
        return {}
    before, after = points[-2], points[-1]
    gains = {"all": after["tau"] / before["tau"] - 1}
    for kind, tau in after.get("tau_by_kind", {}).items():
        if kind in before.get("tau_by_kind", {}):
            gains[kind] = tau / before["tau_by_kind"][kind] - 1
    return gains


def set_letters(points: list[dict]) -> dict[str, str]:
    """A letter per held-out set, in the order the curve meets them."""
    letters: dict[str, str] = {}
    for p in points:
        letters.setdefault(p["heldout"], chr(ord("A") + len(letters)))
    return letters


def markdown(curves: dict[str, list[dict]]) -> str:
    lines = ["# Learning curve", "",
             "Held-out, teacher-forced, per head: loss, chain tau and tau per kind of prompt against the real",
             "tokens the campaign has trained (segment 0: the heads it started from), after each segment. Each",
             "number is measured on one set of held-out answers (column \"set\"); where the set changes, the",
             "segment's start is listed too, so compare rows of one set only. A count marked ~ includes a",
             "segment whose token count is an estimate (its record says why). Written by `python -m",
             "jetspec_jax.train.learning_curve`.", ""]
    for head, points in curves.items():
        kinds = sorted({k for p in points for k in p.get("tau_by_kind", {})})
        letters = set_letters(points)
        lines += [f"## {head}", "", "| segment | set | real tokens | loss | tau | " + " | ".join(kinds) + " |",
                  "|---" * (5 + len(kinds)) + "|"]
        for p in points:
            by_kind = p.get("tau_by_kind", {})
            tokens = ("~" if p.get("tokens_estimated") else "") + f"{p['tokens'] / 1e6:.1f}M"
            lines.append(f"| {p['segment']} | {letters[p['heldout']]} | {tokens} | {p['loss']:.3f} | "
                         f"{p['tau']:.2f} | " + " | ".join(f"{by_kind[k]:.2f}" if k in by_kind else "" for k in kinds)
                         + " |")
        gains = growth(points)
        if gains:
            flat = sorted(k for k, g in gains.items() if k != "all" and g < FLAT)
            lines += ["", f"Over the last segment tau grew {100 * gains['all']:+.1f}% pooled; "
                      + (f"under {100 * FLAT:.0f}% (flat) on: {', '.join(flat)}." if flat
                         else f"every kind grew by {100 * FLAT:.0f}% or more.")]
        lines.append("")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], path: str) -> None:
    """tau per kind against tokens; a line joins points of one held-out set only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (head, points) in zip(axes.flat, curves.items()):
        kinds = sorted({k for p in points for k in p.get("tau_by_kind", {})})
        for n, (_, run) in enumerate(itertools.groupby(points, key=lambda p: p["heldout"])):
            run = list(run)
            tokens = [p["tokens"] / 1e6 for p in run]
            for i, kind in enumerate(kinds):
                ax.plot(tokens, [p.get("tau_by_kind", {}).get(kind) for p in run], marker="o", color=f"C{i}",
                        label=kind if n == 0 else None)
            ax.plot(tokens, [p["tau"] for p in run], marker="s", color="black", linewidth=2.5,
                    label="all" if n == 0 else None)
        ax.set(title=head, xlabel="real tokens trained in the campaign (M)", ylabel="held-out tau")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, png.getvalue())


def write_learning_curve(directory: str) -> dict[str, list[dict]]:
    curves = curve_points(read_records(directory))
    write_json_atomic(os.path.join(directory, "learning_curve.json"), curves)
    write_bytes_atomic(os.path.join(directory, "learning_curve.md"), markdown(curves).encode("utf-8"))
    plot(curves, os.path.join(directory, "learning_curve.png"))
    return curves


def learning_curve_command(argv=None) -> int:
    p = OneLineErrorParser(prog="python -m jetspec_jax.train.learning_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("campaign", help="the campaign folder (holding segments.jsonl)")
    args = p.parse_args(argv)
    write_learning_curve(args.campaign)
    print(f"wrote learning_curve.md, .json and .png in {args.campaign}")
    return 0


def main(argv=None) -> int:
    return run_command(learning_curve_command, argv)


if __name__ == "__main__":
    sys.exit(main())
