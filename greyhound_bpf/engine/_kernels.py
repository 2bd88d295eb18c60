"""Numba kernels of the streaming engine. Private: they take plain arrays and
scalars; the public classes in greyhound_bpf.engine validate arguments and
hold the state. Every kernel is compiled once and cached on disk
(cache=True), so a warm start pays no compilation.
"""
from __future__ import annotations

import math
import os

# Numba caches compiled kernels beside this file. A user who cannot write
# there (an unprivileged `greyhound-trace replay` of a root-owned install)
# gets a per-user cache instead of an import error.
if not os.access(os.path.dirname(os.path.abspath(__file__)), os.W_OK):
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        if os.access(os.path.expanduser("~"), os.W_OK) else f"/tmp/greyhound-{os.getuid()}",
        "greyhound-numba"))

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402


# Reassociation lets LLVM vectorise the lag sums; results stay within
# ~1e-15 of statsmodels (tests/test_engine.py checks 1e-9).
SUMS = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=SUMS)
def acf(x, nlags):
    """Sample autocorrelation, as statsmodels.tsa.stattools.acf(x, nlags,
    adjusted=False, fft=False): the autocovariance at each lag summed over
    the overlapping pairs and divided by n, over the lag-0 value."""
    n = x.shape[0]
    out = np.zeros(nlags + 1)
    if n == 0:
        return out
    mean = 0.0
    for i in range(n):
        mean += x[i]
    mean /= n
    d = np.empty(n)
    for i in range(n):
        d[i] = x[i] - mean
    c0 = 0.0
    for i in range(n):
        c0 += d[i] * d[i]
    if c0 == 0.0:
        out[:] = np.nan
        return out
    for k in range(nlags + 1):
        s = 0.0
        for i in range(n - k):
            s += d[i] * d[i + k]
        out[k] = s / c0
    return out


@njit(cache=True, fastmath=SUMS)
def categorical_acf(tokens, ntypes, nlags):
    """ACF of the one-hot encoding of a token sequence, summed over types.

    Call types are nominal: the ACF of their integer ids depends on how the
    ids happen to be numbered. The one-hot form does not, and it reduces to
    counting matches: sum_c sum_t (x_ct - m_c)(x_c,t+k - m_c) =
    sum_t ([s_t == s_t+k] - m[s_t] - m[s_t+k] + Q), Q = sum_c m_c^2.
    """
    n = tokens.shape[0]
    out = np.zeros(nlags + 1)
    if n == 0:
        return out
    m = np.zeros(ntypes)
    for i in range(n):
        m[tokens[i]] += 1.0
    q = 0.0
    for c in range(ntypes):
        m[c] /= n
        q += m[c] * m[c]
    c0 = n * (1.0 - q)
    if c0 <= 0.0:
        out[:] = np.nan
        return out
    for k in range(nlags + 1):
        s = 0.0
        for i in range(n - k):
            a = tokens[i]
            b = tokens[i + k]
            s += (1.0 if a == b else 0.0) - m[a] - m[b] + q
        out[k] = s / c0
    return out


@njit(cache=True)
def _t_logpdf(x, lgd, alpha, loc, scale2):
    """Student-t log density with nu = 2 alpha, given
    lgd = lgamma(alpha + 1/2) - lgamma(alpha), carried per hypothesis: when
    alpha grows by 1/2 it becomes log(alpha) - lgd (lgamma(a + 1) =
    lgamma(a) + log a), one log instead of two lgammas per update."""
    nu = 2.0 * alpha
    z = (x - loc) * (x - loc) / (nu * scale2)
    return lgd - 0.5 * math.log(nu * math.pi * scale2) - (alpha + 0.5) * math.log1p(z)


@njit(cache=True)
def _student_t_logpdf(x, nu, loc, scale2):
    z = (x - loc) * (x - loc) / (nu * scale2)
    return (math.lgamma(0.5 * (nu + 1.0)) - math.lgamma(0.5 * nu)
            - 0.5 * math.log(nu * math.pi * scale2) - 0.5 * (nu + 1.0) * math.log1p(z))


# BOCD state layout: one (NROWS, capacity) float64 array, a row per quantity,
# one column per kept hypothesis. Few arguments keep Numba's per-call
# dispatch cheap, which matters at one call per observation.
RL, LOGP, MU, KAPPA, ALPHA, BETA, LGD = 0, 1, 2, 3, 4, 5, 6
NROWS = 7
# params: log hazard, log(1 - hazard), mu0, kappa0, alpha0, beta0, log prune, max runs
P_LOGH, P_LOG1MH, P_MU0, P_KAPPA0, P_ALPHA0, P_BETA0, P_LOGPRUNE, P_RMAX = range(8)


@njit(cache=True)
def bocd_step(x, n, st, nst, params):
    """One Adams & MacKay update with a Normal-Gamma model.

    `st` holds n hypotheses: a run length (observations in the current
    segment, x included after the update), its log posterior mass and its
    Normal-Gamma parameters. The new state goes to `nst`. Hypotheses whose
    mass falls under the prune level are dropped and at most rmax are kept,
    so an update is O(rmax) however long the series. Returns (new n, log
    evidence of x, MAP run length, MAP posterior mass).
    """
    log_h, log_1mh = params[P_LOGH], params[P_LOG1MH]
    mu0, kappa0, alpha0, beta0 = params[P_MU0], params[P_KAPPA0], params[P_ALPHA0], params[P_BETA0]
    log_prune, rmax = params[P_LOGPRUNE], int(params[P_RMAX])
    # The change hypothesis: x starts a new segment, under the prior
    # predictive, with mass H (the prior mass is 1 after normalisation).
    lp0 = _student_t_logpdf(x, 2.0 * alpha0, mu0, beta0 * (kappa0 + 1.0) / (alpha0 * kappa0))
    nst[RL, 0] = 1.0
    nst[LOGP, 0] = log_h + lp0
    nst[KAPPA, 0] = kappa0 + 1.0
    nst[MU, 0] = (kappa0 * mu0 + x) / (kappa0 + 1.0)
    nst[ALPHA, 0] = alpha0 + 0.5
    nst[BETA, 0] = beta0 + kappa0 * (x - mu0) * (x - mu0) / (2.0 * (kappa0 + 1.0))
    nst[LGD, 0] = math.log(alpha0) - (math.lgamma(alpha0 + 0.5) - math.lgamma(alpha0))
    m = 1
    # Growth: each run extends with x, weighted by its predictive density.
    for i in range(n):
        kap, mu, alp, bet, lgd = st[KAPPA, i], st[MU, i], st[ALPHA, i], st[BETA, i], st[LGD, i]
        lp = _t_logpdf(x, lgd, alp, mu, bet * (kap + 1.0) / (alp * kap))
        k1 = kap + 1.0
        nst[LGD, m] = math.log(alp) - lgd
        nst[RL, m] = st[RL, i] + 1.0
        nst[LOGP, m] = st[LOGP, i] + lp + log_1mh
        nst[KAPPA, m] = k1
        nst[MU, m] = (kap * mu + x) / k1
        nst[ALPHA, m] = alp + 0.5
        nst[BETA, m] = bet + kap * (x - mu) * (x - mu) / (2.0 * k1)
        m += 1
    # Prune hypotheses negligible next to the heaviest (relative mass, so
    # one normalisation pass suffices), then keep the rmax heaviest.
    mx = nst[LOGP, _argmax_logp(nst, m)]
    k = 0
    for i in range(m):
        if nst[LOGP, i] - mx >= log_prune:
            if k != i:
                for r in range(NROWS):
                    nst[r, k] = nst[r, i]
            k += 1
    if k > rmax:
        order = np.argsort(-nst[LOGP, :k])[:rmax]
        order.sort()
        kept = nst[:, order].copy()
        k = rmax
        nst[:, :k] = kept
    # Evidence of x: the mass before normalisation (pruned terms are
    # negligible by construction).
    total = _normalise(nst, k)
    best = _argmax_logp(nst, k)
    return k, total, int(nst[RL, best]), math.exp(nst[LOGP, best])


@njit(cache=True)
def _argmax_logp(st, n):
    best = 0
    for i in range(1, n):
        if st[LOGP, i] > st[LOGP, best]:
            best = i
    return best


@njit(cache=True)
def _normalise(st, n):
    mx = st[LOGP, _argmax_logp(st, n)]
    s = 0.0
    for i in range(n):
        s += math.exp(st[LOGP, i] - mx)
    c = mx + math.log(s)
    for i in range(n):
        st[LOGP, i] -= c
    return c


@njit(cache=True)
def mass_run_at_most(st, n, r):
    s = 0.0
    for i in range(n):
        if st[RL, i] <= r:
            s += math.exp(st[LOGP, i])
    return s


@njit(cache=True)
def bocd_run(xs, params):
    """BOCD over a whole series: the MAP run length after each observation."""
    cap = int(params[P_RMAX]) + 2
    a = np.zeros((NROWS, cap))
    b = np.zeros((NROWS, cap))
    n = 0
    out = np.empty(xs.shape[0], dtype=np.int64)
    for t in range(xs.shape[0]):
        n, _, rl, _ = bocd_step(xs[t], n, a, b, params)
        a, b = b, a
        out[t] = rl
    return out


@njit(cache=True)
def find_gram(tokens, gram):
    """Positions where `gram` starts in `tokens`."""
    n, k = tokens.shape[0], gram.shape[0]
    out = np.empty(max(n - k + 1, 0), dtype=np.int64)
    m = 0
    for i in range(n - k + 1):
        ok = True
        for j in range(k):
            if tokens[i + j] != gram[j]:
                ok = False
                break
        if ok:
            out[m] = i
            m += 1
    return out[:m]


@njit(cache=True)
def score_anchors(tokens, gaps, period, k, tol, min_good):
    """For every phase of the last full period in `tokens`, how well the
    k-gram starting there marks iterations: the share of its consecutive
    occurrences spaced one period apart (within tol), times how close its
    count is to one per period. Also returns each phase's median preceding
    time gap (the iteration start is where the host waited longest).
    """
    n = tokens.shape[0]
    base = n - 2 * period - k
    if base < 0:
        base = 0
    scores = np.zeros(period)
    lead_gap = np.zeros(period)
    expected = n / period
    lo = period * (1.0 - tol)
    hi = period * (1.0 + tol)
    for ph in range(period):
        p0 = base + ph
        if p0 + k > n:
            continue
        pos = find_gram(tokens, tokens[p0:p0 + k])
        if pos.shape[0] < 2:
            continue
        good = 0
        for i in range(1, pos.shape[0]):
            g = pos[i] - pos[i - 1]
            if g >= lo and g <= hi:
                good += 1
        if good < min_good:
            continue
        regular = good / (pos.shape[0] - 1)
        count_fit = min(pos.shape[0], expected) / max(pos.shape[0], expected)
        scores[ph] = regular * count_fit
        lg = np.empty(pos.shape[0])
        for i in range(pos.shape[0]):
            lg[i] = gaps[pos[i]]
        lead_gap[ph] = np.median(lg)
    return scores, lead_gap


@njit(cache=True)
def union_ns(starts, ends):
    """Length of the union of [start, end) intervals (calls on several
    threads overlap: gloo runs buckets on two)."""
    n = starts.shape[0]
    if n == 0:
        return 0
    order = np.argsort(starts)
    total = 0
    cur_s = starts[order[0]]
    cur_e = ends[order[0]]
    for j in range(1, n):
        i = order[j]
        if starts[i] > cur_e:
            total += cur_e - cur_s
            cur_s = starts[i]
            cur_e = ends[i]
        elif ends[i] > cur_e:
            cur_e = ends[i]
    total += cur_e - cur_s
    return total


@njit(cache=True)
def level_shift(old, new, floor_scale, min_z, limit):
    """Compare a new segment of log iteration times with the old level.

    Returns (kind, m_old, m_new): kind 1 for slower, -1 for faster, 0 for
    no reportable change. See SlowdownDetector for the rule: the clipped
    mean of the new values must be min_z standard errors from the old
    median, and the median shift's one-standard-error bound must reach
    `limit` (log of 1 + threshold).
    """
    m_old = np.median(old)
    m_new = np.median(new)
    scale = 1.4826 * np.median(np.abs(old - m_old))
    if scale < floor_scale:
        scale = floor_scale
    if scale < 1e-3:
        scale = 1e-3
    n_new, n_old = new.shape[0], old.shape[0]
    se = 1.25 * scale * math.sqrt(1.0 / n_new + 1.0 / n_old)
    lo, hi = m_old - 3.0 * scale, m_old + 3.0 * scale
    acc = 0.0
    for v in new:
        acc += min(max(v, lo), hi)
    z = (acc / n_new - m_old) / (scale * math.sqrt(1.0 / n_new + 1.5625 / n_old))
    if z >= min_z and m_new - m_old + se >= limit:
        return 1, m_old, m_new
    if z <= -min_z and m_new - m_old - se <= -limit:
        return -1, m_old, m_new
    return 0, m_old, m_new
