"""Unpruned pure-NumPy BOCD (Adams & MacKay 2007), the reference that the
Numba engine is checked against (tests/test_engine.py) and raced
(scripts/bench_engine); and TCPD's two scores of a segmentation against
people's annotations (F1 with a margin, covering), from van den Burg &
Williams (2020)'s definitions, for scripts/bench_changepoints. Same model and parametrisation: Normal-Gamma prior,
constant hazard, run length = observations in the current segment
including the newest. Every run length is kept: O(t) per update.
"""
import numpy as np
from scipy.special import gammaln


def student_t_logpdf(x, nu, loc, scale2):
    z = (x - loc) ** 2 / (nu * scale2)
    return (gammaln((nu + 1) / 2) - gammaln(nu / 2) - 0.5 * np.log(nu * np.pi * scale2)
            - (nu + 1) / 2 * np.log1p(z))


class ReferenceBOCD:
    def __init__(self, hazard, mu0, kappa0, alpha0, beta0):
        self.h, self.mu0, self.kappa0, self.alpha0, self.beta0 = hazard, mu0, kappa0, alpha0, beta0
        self.logp = np.empty(0)
        self.mu = np.empty(0)
        self.kappa = np.empty(0)
        self.alpha = np.empty(0)
        self.beta = np.empty(0)

    def update(self, x):
        lp0 = student_t_logpdf(x, 2 * self.alpha0, self.mu0,
                               self.beta0 * (self.kappa0 + 1) / (self.alpha0 * self.kappa0))
        lp = student_t_logpdf(x, 2 * self.alpha, self.mu,
                              self.beta * (self.kappa + 1) / (self.alpha * self.kappa))
        grow = self.logp + lp + np.log1p(-self.h)
        new = np.log(self.h) + lp0
        logp = np.concatenate([[new], grow])
        logp -= np.logaddexp.reduce(logp)
        mu = np.concatenate([[self.mu0], self.mu])
        kappa = np.concatenate([[self.kappa0], self.kappa])
        alpha = np.concatenate([[self.alpha0], self.alpha])
        beta = np.concatenate([[self.beta0], self.beta])
        self.beta = beta + kappa * (x - mu) ** 2 / (2 * (kappa + 1))
        self.mu = (kappa * mu + x) / (kappa + 1)
        self.kappa = kappa + 1
        self.alpha = alpha + 0.5
        self.logp = logp
        return int(np.argmax(logp)) + 1      # MAP run length

    @property
    def probabilities(self):
        return np.exp(self.logp)             # index i: run length i + 1


def reference_changepoints(x, hazard, mu0, kappa0, alpha0, beta0):
    """Segment starts read back from the reference's MAP run lengths, with
    the engine's reader: what is checked is the BOCD, not the read-back."""
    from greyhound_bpf.engine import map_segment_starts
    b = ReferenceBOCD(hazard, mu0, kappa0, alpha0, beta0)
    return map_segment_starts(np.array([b.update(v) for v in x]))


MARGIN = 5


def _matched(truth: list[int], pred: list[int], margin: int) -> int:
    """Predictions within `margin` of a true point, each true point used once."""
    used, hits = set(), 0
    for p in pred:
        near = [t for t in truth if abs(t - p) <= margin and t not in used]
        if near:
            used.add(min(near, key=lambda t: abs(t - p)))
            hits += 1
    return hits


def f1(annotations: dict[str, list[int]], pred: list[int], margin: int = MARGIN) -> float:
    pred = sorted({0, *pred})
    union = sorted({0, *(c for cps in annotations.values() for c in cps)})
    precision = _matched(union, pred, margin) / len(pred)
    recall = np.mean([_matched(sorted({0, *cps}), pred, margin) / len({0, *cps})
                      for cps in annotations.values()])
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def _segments(cps: list[int], n: int) -> list[tuple[int, int]]:
    b = sorted({0, *[c for c in cps if 0 < c < n], n})
    return list(zip(b, b[1:]))


def covering(annotations: dict[str, list[int]], pred: list[int], n: int) -> float:
    mine = _segments(pred, n)

    def jaccard(a, b):
        inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
        return inter / (max(a[1], b[1]) - min(a[0], b[0]))
    scores = []
    for cps in annotations.values():
        theirs = _segments(cps, n)
        scores.append(sum((e - s) * max(jaccard((s, e), m) for m in mine)
                          for s, e in theirs) / n)
    return float(np.mean(scores))
