"""A cost model of the AR and speculative steps (shape, batch, budget, context -> ms) fitted to step_floor
rows of one device, and its error on rows held back from the fit.

    python benchmarks/step_cost.py benchmarks/results/step_floor_h100.json \\
        benchmarks/results/step_floor_draft_vocab_h100.json --out benchmarks/results/step_cost_h100.json

Each pass is costed from what it must move and compute (shapes.py), in the device's measured ceilings,
with coefficients that price what the floor leaves out:

    pass       = floor_scale x max(bytes / bandwidth, GEMM FLOPs / matmul rate)
                 + attention_scale x attention FLOPs / matmul rate + layer_ms x layers
    AR step    = the target's pass over one token a row
    spec step  = the head's pass + the target's pass over the tree + step_ms + node_ms x rows x budget

The five coefficients are non-negative, fitted by least squares on relative error over every AR and
speculative step the rows hold. A row's held-back prediction comes from a fit without it (and without
its AR step when no other row shares that batch and context), so the error printed beside it is the
model's error on a point it never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402
from shapes import SHAPES, attention_flops, draft_pass_cost, pass_cost, shape_config  # noqa: E402

from jetspec_jax.models import draft_head  # noqa: E402

COEFFICIENTS = ("floor_scale", "attention_scale", "layer_ms", "step_ms", "node_ms")
SHAPE_OF = {"embedded": "smollm2-135m-shaped"}  # the embedded target's shape; its shipped head is 3 layers
ITEMSIZE = 2  # bf16: the rows step_floor records


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration a step is costed at."""
    model: str
    batch: int
    context: int
    budget: int | None  # None: the AR step
    draft_vocab: int | None = None
    target_layers: int | None = None  # None: the whole shape (rows from before step_floor recorded it)
    head_layers: int | None = None  # None: the shape's paper-sized head


def pass_features(point: Point, ceilings: dict) -> np.ndarray:
    """The step's costs in the model's linear terms (ms at the ceilings, layers, a constant, nodes)."""
    shape = SHAPE_OF.get(point.model, point.model)
    cfg, default_layers = shape_config(shape, point.target_layers), SHAPES[shape][2]
    bandwidth = ceilings["copy_bytes_per_s"] / 1e3
    rate = ceilings["matmul_bf16_flops_per_s"] / 1e3

    def roofline(cost, attention):
        nbytes, flops = cost
        return max(nbytes / bandwidth, (flops - attention) / rate), attention / rate

    tokens = point.budget or 1
    verify_attention = attention_flops(cfg.num_heads, cfg.head_dim, cfg.num_layers, tokens * point.batch,
                                       point.context + tokens)
    floor, attention = roofline(pass_cost(cfg, tokens, point.batch, point.context, ITEMSIZE), verify_attention)
    layers = cfg.num_layers
    if point.budget is None:
        return np.array([floor, attention, layers, 0.0, 0.0])
    head = draft_head.DraftConfig.for_target(cfg, num_layers=point.head_layers or default_layers)
    slots = point.batch * head.block_size
    head_attention = attention_flops(head.num_heads, head.head_dim, head.num_layers, slots,
                                     point.context + head.block_size)
    head_floor, head_attn = roofline(draft_pass_cost(head, cfg, point.batch, point.context, ITEMSIZE,
                                                     point.draft_vocab), head_attention)
    return np.array([floor + head_floor, attention + head_attn, layers + head.num_layers, 1.0,
                     point.batch * point.budget])


def fit(features: np.ndarray, measured_ms: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of the predictions."""
    weights = 1.0 / measured_ms
    coefficients, _ = nnls(features * weights[:, None], measured_ms * weights)
    return coefficients


def observations(rows: list[dict], ceilings: dict) -> tuple[list[Point], np.ndarray, np.ndarray, list[list[int]]]:
    """(points, features, measured ms, each row's observation indices) of the rows' AR and speculative
    steps; an AR step shared by rows (the same configuration and time: one measurement) is one observation."""
    points, measured, index_of, per_row = [], [], {}, []
    for row in rows:
        ar = Point(row["model"], row["batch"], row["context"], None, None, row.get("target_layers"))
        spec = dataclasses.replace(ar, budget=row["budget"], draft_vocab=row.get("draft_vocab"),
                                   head_layers=row.get("head_layers"))
        mine = []
        for point, ms in ((ar, row["ar_step_ms"]), (spec, row["loop_step_ms"])):
            if (point, ms) not in index_of:
                index_of[point, ms] = len(points)
                points.append(point)
                measured.append(ms)
            mine.append(index_of[point, ms])
        per_row.append(mine)
    features = np.stack([pass_features(p, ceilings) for p in points])
    return points, features, np.asarray(measured, float), per_row


def held_back(rows: list[dict], ceilings: dict) -> dict:
    """The fit on every row, and each row's AR and speculative steps predicted by a fit without that row."""
    points, features, measured, per_row = observations(rows, ceilings)
    whole = fit(features, measured)
    predictions = []
    for mine in per_row:
        shared = {i for other in per_row if other is not mine for i in other}
        keep = np.array([i not in mine or i in shared for i in range(len(points))])
        keep[mine[1]] = False
        coefficients = fit(features[keep], measured[keep])
        ar_ms, step_ms = (float(features[i] @ coefficients) for i in mine)
        predictions.append(dict(model_ar_ms=ar_ms, model_step_ms=step_ms))
    return dict(coefficients=dict(zip(COEFFICIENTS, map(float, whole))), predictions=predictions)


def run_ceilings(payload: dict, device: str) -> dict:
    """The ceilings of the newest run that measured on `device` (every step_floor run records them)."""
    device_runs = {r["run"] for r in payload["rows"] if r["device"] == device}
    return payload["runs"][max(device_runs)]["ceilings"]


def read_step_floor(path: str) -> dict:
    """A step_floor result file, or a one-line exit naming what it is not."""
    with open(path) as f:
        payload = json.load(f)
    if payload.get("benchmark") != "step_floor":
        raise SystemExit(f"error: {path} is not a step_floor result (benchmarks/step_floor.py writes them)")
    return payload


def load_rows(paths: list[str], device: str | None) -> tuple[str, list[dict], dict]:
    """(device, rows, ceilings) of step_floor files: one device's rows (the only one, unless named)."""
    rows, ceilings = [], None
    for path in paths:
        payload = read_step_floor(path)
        devices = sorted({r["device"] for r in payload["rows"]})
        if device is None and len(devices) > 1:
            raise SystemExit(f"error: {path} holds rows of {', '.join(devices)}; name one with --device")
        device = device or (devices[0] if devices else None)
        mine = [r for r in payload["rows"] if r["device"] == device]
        if mine:
            rows += mine
            ceilings = ceilings or run_ceilings(payload, device)
    if not rows:
        raise SystemExit(f"error: no step_floor rows of {device or 'any device'} in {', '.join(paths)}")
    return device, rows, ceilings


def with_predictions(rows: list[dict], ceilings: dict) -> tuple[list[dict], dict]:
    """The rows with their held-back predictions and relative errors beside them, and the whole fit."""
    result = held_back(rows, ceilings)
    table = []
    for row, predicted in zip(rows, result["predictions"]):
        table.append(dict(row, **predicted,
                          model_step_error=predicted["model_step_ms"] / row["loop_step_ms"] - 1,
                          model_step_over_ar=predicted["model_step_ms"] / predicted["model_ar_ms"],
                          model_ratio_error=(predicted["model_step_ms"] / predicted["model_ar_ms"])
                          / row["step_over_ar"] - 1))
    return table, result["coefficients"]


COLUMNS = ["model", "batch", "context", "budget", "draft_vocab", "loop_step_ms", "model_step_ms",
           "model_step_error", "step_over_ar", "model_step_over_ar", "model_ratio_error"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="step_floor result files (benchmarks/step_floor.py --out)")
    p.add_argument("--device", default=None, help="the device whose rows to fit (when a file holds several)")
    p.add_argument("--out", default=None, help="write the fit and the held-back predictions here (JSON)")
    args = p.parse_args()
    device, rows, ceilings = load_rows(args.results, args.device)
    if len(rows) < 2:
        raise SystemExit(f"error: {len(rows)} row of {device}: a held-back error needs at least two")
    table, coefficients = with_predictions(rows, ceilings)
    print_table(table, COLUMNS)
    errors = np.abs([r["model_step_error"] for r in table])
    summary = dict(rows=len(table), max_abs_step_error=float(errors.max()),
                   median_abs_step_error=float(np.median(errors)),
                   within_10_percent=int((errors <= 0.10).sum()))
    print(f"{device}: {len(table)} rows; held-back step error median {summary['median_abs_step_error']:.1%}, "
          f"max {summary['max_abs_step_error']:.1%}; fit on all: "
          + ", ".join(f"{k} {v:.4g}" for k, v in coefficients.items()))
    if args.out:
        write_json_atomic(args.out, dict(benchmark="step_cost", environment=environment(), device=device,
                                         sources=args.results,
                                         ceilings=ceilings, coefficients=coefficients, summary=summary,
                                         rows=[{k: r.get(k) for k in COLUMNS + ["ar_step_ms", "model_ar_ms"]}
                                               for r in table]))


if __name__ == "__main__":
    main()
