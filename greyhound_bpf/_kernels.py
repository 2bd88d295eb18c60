"""Numba kernels of the streaming engine. Private: they take plain arrays and
scalars; the public classes in greyhound_bpf.engine validate arguments and
hold the state. Every kernel is compiled once and cached on disk
(cache=True), so a warm start pays no compilation.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
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


@njit(cache=True)
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
def _student_t_logpdf(x, nu, loc, scale2):
    z = (x - loc) * (x - loc) / (nu * scale2)
    return (math.lgamma(0.5 * (nu + 1.0)) - math.lgamma(0.5 * nu)
            - 0.5 * math.log(nu * math.pi * scale2) - 0.5 * (nu + 1.0) * math.log1p(z))


@njit(cache=True)
def bocd_step(x, n, rl, logp, mu, kappa, alpha, beta,
              log_h, log_1mh, mu0, kappa0, alpha0, beta0, log_prune, rmax,
              nrl, nlogp, nmu, nkappa, nalpha, nbeta):
    """One Adams & MacKay update with a Normal-Gamma model.

    State: n hypotheses, each a run length rl[i] (observations in the current
    segment, x included after the update), its log posterior mass and its
    Normal-Gamma parameters. Writes the new state into the n* arrays and
    returns (new n, log evidence of x). Hypotheses whose mass falls under
    exp(log_prune) are dropped and at most rmax are kept, so an update is
    O(rmax) however long the series.
    """
    # Growth: each run extends with x, weighted by its predictive density.
    total = -np.inf
    m = 0
    lp0 = _student_t_logpdf(x, 2.0 * alpha0, mu0, beta0 * (kappa0 + 1.0) / (alpha0 * kappa0))
    # The change hypothesis: x starts a new segment, under the prior predictive.
    # Its mass is H times the total prior mass (which is 1 after normalisation).
    nrl[0] = 1
    nlogp[0] = log_h + lp0
    nkappa[0] = kappa0 + 1.0
    nmu[0] = (kappa0 * mu0 + x) / (kappa0 + 1.0)
    nalpha[0] = alpha0 + 0.5
    nbeta[0] = beta0 + kappa0 * (x - mu0) * (x - mu0) / (2.0 * (kappa0 + 1.0))
    m = 1
    for i in range(n):
        s2 = beta[i] * (kappa[i] + 1.0) / (alpha[i] * kappa[i])
        lp = _student_t_logpdf(x, 2.0 * alpha[i], mu[i], s2)
        nrl[m] = rl[i] + 1
        nlogp[m] = logp[i] + lp + log_1mh
        k1 = kappa[i] + 1.0
        nkappa[m] = k1
        nmu[m] = (kappa[i] * mu[i] + x) / k1
        nalpha[m] = alpha[i] + 0.5
        nbeta[m] = beta[i] + kappa[i] * (x - mu[i]) * (x - mu[i]) / (2.0 * k1)
        m += 1
    # Normalise (log-sum-exp).
    mx = -np.inf
    for i in range(m):
        if nlogp[i] > mx:
            mx = nlogp[i]
    s = 0.0
    for i in range(m):
        s += math.exp(nlogp[i] - mx)
    total = mx + math.log(s)
    for i in range(m):
        nlogp[i] -= total
    # Prune negligible mass, then keep the rmax heaviest.
    k = 0
    for i in range(m):
        if nlogp[i] >= log_prune:
            nrl[k] = nrl[i]
            nlogp[k] = nlogp[i]
            nmu[k] = nmu[i]
            nkappa[k] = nkappa[i]
            nalpha[k] = nalpha[i]
            nbeta[k] = nbeta[i]
            k += 1
    if k > rmax:
        order = np.argsort(-nlogp[:k])[:rmax]
        order.sort()
        rl2, lp2, mu2 = nrl[order].copy(), nlogp[order].copy(), nmu[order].copy()
        ka2, al2, be2 = nkappa[order].copy(), nalpha[order].copy(), nbeta[order].copy()
        k = rmax
        nrl[:k] = rl2
        nlogp[:k] = lp2
        nmu[:k] = mu2
        nkappa[:k] = ka2
        nalpha[:k] = al2
        nbeta[:k] = be2
    # Renormalise what is kept.
    mx = -np.inf
    for i in range(k):
        if nlogp[i] > mx:
            mx = nlogp[i]
    s = 0.0
    for i in range(k):
        s += math.exp(nlogp[i] - mx)
    c = mx + math.log(s)
    for i in range(k):
        nlogp[i] -= c
    return k, total


@njit(cache=True)
def bocd_run(xs, log_h, mu0, kappa0, alpha0, beta0, log_prune, rmax):
    """BOCD over a whole series: the MAP run length after each observation."""
    cap = rmax + 2
    bufs = [np.empty(cap) for _ in range(12)]
    rl = np.zeros(cap, dtype=np.int64)
    nrl = np.zeros(cap, dtype=np.int64)
    logp, mu, kappa, alpha, beta = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4]
    nlogp, nmu, nkappa, nalpha, nbeta = bufs[5], bufs[6], bufs[7], bufs[8], bufs[9]
    n = 0
    log_1mh = math.log1p(-math.exp(log_h))
    out = np.empty(xs.shape[0], dtype=np.int64)
    for t in range(xs.shape[0]):
        n, _ = bocd_step(xs[t], n, rl, logp, mu, kappa, alpha, beta, log_h, log_1mh,
                         mu0, kappa0, alpha0, beta0, log_prune, rmax,
                         nrl, nlogp, nmu, nkappa, nalpha, nbeta)
        rl, nrl = nrl, rl
        logp, nlogp = nlogp, logp
        mu, nmu = nmu, mu
        kappa, nkappa = nkappa, kappa
        alpha, nalpha = nalpha, alpha
        beta, nbeta = nbeta, beta
        best = 0
        for i in range(n):
            if logp[i] > logp[best]:
                best = i
        out[t] = rl[best]
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
