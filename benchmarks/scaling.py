"""The scaling model of the report: cmap's time at P real cores from measured parts (single-process vmap, a fitted
ring all_gather, cmap's fixed overhead)."""

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np


def fit_comm(timing: Sequence[Dict[str, Any]]) -> Tuple[float, float, float]:
    """Fit ``T_comm(P, S) = alpha * (P - 1) + beta * S * (P - 1) / P`` to the measured ``gather_only`` times.

    Returns:
        (alpha seconds, beta seconds per byte, relative RMS residual), both coefficients kept non-negative.
    """
    rows, ys = [], []
    for r in timing:
        if r["P"] < 2:
            continue
        p, s = r["P"], r["out_bytes"]
        rows.append([p - 1, s * (p - 1) / p])
        ys.append(r["times"]["gather_only"]["median_s"])
    if not rows:
        return 0.0, 0.0, 0.0
    a, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)  # relative least squares: small and large messages count alike
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0 or beta < 0:
        col = 1 if alpha < 0 else 0
        only, *_ = np.linalg.lstsq(a[:, col : col + 1] * w[:, None], y * w, rcond=None)
        alpha, beta = (0.0, float(only[0])) if col == 1 else (float(only[0]), 0.0)
    pred = a @ np.array([alpha, beta])
    resid = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    return alpha, beta, resid


def model_time(r: Dict[str, Any], p: int, alpha: float, beta: float, overhead: float) -> float:
    """Modelled time of one cmap call on ``p`` real cores: sharded compute + all_gather + cmap's fixed overhead."""
    t1 = r["times"]["vmap_full"]["median_s"]
    if p == 1:
        return t1
    rows = math.ceil(r["batch"] / p)
    s = r["out_bytes"]
    return t1 * rows / r["batch"] + alpha * (p - 1) + beta * s * (p - 1) / p + overhead


def overheads(timing: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """cmap's fixed cost over the baseline per case: the median over P of ``cmap - baseline`` (at least 0)."""
    out: Dict[str, List[float]] = {}
    for r in timing:
        if r["P"] < 2:
            continue
        out.setdefault(r["case"], []).append(r["times"]["cmap"]["median_s"] - r["times"]["baseline"]["median_s"])
    return {k: max(float(np.median(v)), 0.0) for k, v in out.items()}
