"""Float64 NumPy references for the GRPO-family losses, written from the formulas of docs/algorithms/grpo.md.

Independent of ``jrl.losses``: explicit loops over sequences and tokens, plain NumPy, no JAX. Only
the config object is read (as data). The tests compare the implementation against these.
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-4  # docs/algorithms/grpo.md §1.2 / §1.3
LOG_RATIO_MAX = 20.0  # jrl's overflow clamp on log-ratios (documented in jrl.losses.policy)


def f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# statistics (torch conventions: Bessel-corrected std, 0 over one value)


def std1(values) -> float:
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size <= 1:
        return 0.0
    mu = sum(v) / v.size
    return math.sqrt(sum((x - mu) ** 2 for x in v) / (v.size - 1))


def nanmean(values) -> float:
    v = [x for x in np.asarray(values, dtype=np.float64).ravel() if not math.isnan(x)]
    return float("nan") if not v else sum(v) / len(v)


def nanstd1(values) -> float:
    v = [x for x in np.asarray(values, dtype=np.float64).ravel() if not math.isnan(x)]
    if not v:
        return float("nan")
    return std1(v)


# ---------------------------------------------------------------------------------------------
# advantages (§1)


def as_2d(rewards):
    r = f64(rewards)
    return r[:, None] if r.ndim == 1 else r


def combine(rewards, weights=None) -> np.ndarray:
    r = as_2d(rewards)
    n, k = r.shape
    w = np.ones(k) if weights is None else f64(weights)
    out = np.zeros(n)
    for i in range(n):
        for j in range(k):
            if not math.isnan(r[i, j]):
                out[i] += w[j] * r[i, j]
    return out


def adv_sum_then_normalize(rewards, G, weights=None, scale="group") -> np.ndarray:
    r = combine(rewards, weights)
    n = len(r)
    batch_std = std1(r)
    a = np.zeros(n)
    for g0 in range(0, n, G):
        grp = r[g0 : g0 + G]
        mean = sum(grp) / G
        sigma = std1(grp) if scale == "group" else batch_std
        for i in range(g0, g0 + G):
            a[i] = r[i] - mean
            if scale != "none":
                a[i] /= sigma + EPS
    return a


def adv_normalize_then_sum(rewards, G, weights=None) -> np.ndarray:
    r = as_2d(rewards)
    n, k = r.shape
    w = np.ones(k) if weights is None else f64(weights)
    s = np.zeros(n)
    for g0 in range(0, n, G):
        for j in range(k):
            col = r[g0 : g0 + G, j]
            mu = nanmean(col)
            sd = nanstd1(col) if G > 1 else 0.0
            for i in range(g0, g0 + G):
                x = (r[i, j] - mu) / (sd + EPS)
                if not math.isnan(x):
                    s[i] += w[j] * x
    mu = sum(s) / n
    return np.array([(x - mu) / (std1(s) + EPS) for x in s])


def adv_rloo(rewards, G, weights=None) -> np.ndarray:
    r = combine(rewards, weights)
    a = np.zeros(len(r))
    for g0 in range(0, len(r), G):
        for i in range(g0, g0 + G):
            others = [r[j] for j in range(g0, g0 + G) if j != i]
            a[i] = r[i] - sum(others) / (G - 1)
    return a


def zero_std_groups(rewards, G, weights=None) -> np.ndarray:
    r = combine(rewards, weights)
    return np.array([abs(std1(r[g0 : g0 + G])) <= 1e-8 for g0 in range(0, len(r), G)])


def reward_metrics_ref(rewards, G, weights=None, names=None) -> dict:
    r2 = as_2d(rewards)
    r = combine(rewards, weights)
    stds = [std1(r[g0 : g0 + G]) for g0 in range(0, len(r), G)]
    names = names or [f"reward_{j}" for j in range(r2.shape[1])]
    out = {
        "reward": sum(r) / len(r),
        "reward_std": sum(stds) / len(stds),
        "frac_reward_zero_std": float(np.mean(zero_std_groups(rewards, G, weights))),
    }
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = nanmean(r2[:, j])
        out[f"rewards/{name}/std"] = nanstd1(r2[:, j])
    return out


# ---------------------------------------------------------------------------------------------
# the loss (§3–§12), in the order of §10


def loss_mask_ref(cm, tool=None, trunc=None, mask_truncated=False) -> np.ndarray:
    m = f64(cm).copy()
    if tool is not None:
        m = m * f64(tool)
    if mask_truncated:
        m = m * (1.0 - f64(trunc))[:, None]
    return m


def quantile_linear(values, q) -> float:
    """torch.quantile / numpy 'linear': sorted x at position q·(n−1), interpolated."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def is_weights_ref(old, samp, m, mode, cap, floor=None):
    """(token weights [B, T], unit ratios list, unit count) per §7 with jrl's open-point-1 rules."""
    b, t = m.shape
    d = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if m[i, j] > 0 and not math.isnan(samp[i, j]):
                d[i, j] = old[i, j] - samp[i, j]

    def weight(log_r):
        r = math.exp(min(log_r, 700.0))
        if mode.endswith("truncate"):
            r = min(r, cap)
            if floor is not None:
                r = max(r, floor)
            return r
        keep = r <= cap and (floor is None or r >= floor)
        return r if keep else 0.0

    w = np.ones((b, t))
    units = []
    for i in range(b):
        if mode.startswith("token"):
            for j in range(t):
                w[i, j] = weight(d[i, j])
                if m[i, j] > 0:
                    units.append(w[i, j])
        else:
            wi = weight(sum(d[i]))
            w[i, :] = wi
            if m[i].sum() > 0:
                units.append(wi)
    return w, units


def loss_ref(
    cfg,
    *,
    lp,
    adv,
    cm,
    old=None,
    ref=None,
    samp=None,
    ent=None,
    tool=None,
    trunc=None,
    global_mask=None,
    num_micro_batches=1,
    ent_thr=None,
):
    """Returns (loss, per_token_loss [B, T], extras dict) for one micro-batch."""
    lp, adv, old, ref, samp, ent = map(f64, (lp, adv, old, ref, samp, ent))
    b, t = lp.shape
    m = loss_mask_ref(cm, tool, trunc, cfg.mask_truncated_completions)
    old = lp.copy() if old is None else old
    n = m.sum(1)
    el = cfg.epsilon
    eh = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high

    # 2. ratio + surrogate
    logrho = np.zeros((b, t))
    for i in range(b):
        if cfg.importance_sampling_level == "token":
            for j in range(t):
                if m[i, j] > 0:
                    logrho[i, j] = min(lp[i, j] - old[i, j], LOG_RATIO_MAX)
        else:
            s = sum(m[i, j] * (lp[i, j] - old[i, j]) for j in range(t) if m[i, j] > 0) / max(1.0, n[i])
            logrho[i, :] = min(s, LOG_RATIO_MAX)
    rho = np.exp(logrho)
    ell = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            r = rho[i, j]
            unclipped = (r if cfg.delta is None else min(r, cfg.delta)) * adv[i]
            clipped = min(max(r, 1 - el), 1 + eh) * adv[i]
            ell[i, j] = -min(unclipped, clipped)
    extras = {"rho": rho, "logrho": logrho, "mask": m}

    # 3. OPSM
    if cfg.off_policy_mask_threshold is not None:
        keep = np.ones(b, bool)
        for i in range(b):
            tot = 0.0
            for j in range(t):
                if m[i, j] > 0:
                    s_ij = old[i, j] if samp is None or math.isnan(samp[i, j]) else samp[i, j]
                    tot += s_ij - lp[i, j]
            kl_i = tot / max(1.0, n[i])
            keep[i] = adv[i] >= 0 or kl_i <= cfg.off_policy_mask_threshold
        ell = ell * keep[:, None]
        extras["opsm_keep"] = keep

    # 4. entropy mask
    if cfg.top_entropy_quantile < 1.0:
        if ent_thr is None:
            vals = [ent[i, j] for i in range(b) for j in range(t) if m[i, j] > 0]
            ent_thr = quantile_linear(vals, 1.0 - cfg.top_entropy_quantile) if vals else -math.inf
        ell = ell * (ent >= ent_thr)

    # 5. sampler IS
    if cfg.importance_sampling_correction and samp is not None:
        w, units = is_weights_ref(
            old, samp, m, cfg.importance_sampling_mode, cfg.importance_sampling_cap, cfg.is_ratio_floor
        )
        ell = ell * w
        extras["is_units"] = units

    # 6. KL
    if cfg.beta != 0.0:
        kl = np.zeros((b, t))
        for i in range(b):
            for j in range(t):
                if m[i, j] > 0:
                    dl = ref[i, j] - lp[i, j]
                    kl[i, j] = math.exp(dl) - dl - 1
        extras["kl"] = kl
        ell = ell + cfg.beta * (kl * rho if cfg.use_bias_correction_kl else kl)

    # 7. aggregate
    gm = m if global_mask is None else f64(global_mask)
    n_seq = float(sum(1 for row in gm.reshape(-1, gm.shape[-1]) if row.sum() > 0))
    n_tok = float(gm.sum())
    lmax = cfg.max_completion_length or t
    lt = cfg.loss_type
    if lt == "grpo":
        loss = sum(sum(ell[i] * m[i]) / max(1.0, n[i]) for i in range(b)) / max(1.0, n_seq)
    elif lt == "bnpo":
        loss = float((ell * m).sum()) / (max(1.0, m.sum()) * num_micro_batches)
    elif lt == "dr_grpo":
        loss = float((ell * m).sum()) / (max(1.0, n_seq) * lmax)
    elif lt == "dapo":
        loss = float((ell * m).sum()) / max(1.0, n_tok)
    else:
        raise ValueError(lt)
    return float(loss), ell, extras


# ---------------------------------------------------------------------------------------------
# metrics (§13)


def policy_metrics_ref(cfg, *, lp, adv, cm, old=None, ref=None, ent=None, tool=None, trunc=None) -> dict:
    lp, adv, old, ent = f64(lp), f64(adv), f64(old), f64(ent)
    _, _, ex = loss_ref(cfg, lp=lp, adv=adv, cm=cm, old=old, ref=ref, ent=ent, tool=tool, trunc=trunc)
    rho, logrho, m = ex["rho"], ex["logrho"], ex["mask"]
    old = lp if old is None else old
    b, t = m.shape
    n = m.sum(1)
    nonempty = [i for i in range(b) if n[i] > 0]
    num_docs = max(1, len(nonempty))
    el = cfg.epsilon
    eh = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    toks = [(i, j) for i in range(b) for j in range(t) if m[i, j] > 0]

    def doc_mean(x):  # per-sequence masked mean, then mean over non-empty sequences
        return sum(sum(x[i, j] for j in range(t) if m[i, j] > 0) / n[i] for i in nonempty) / num_docs

    def tok_mean(x):
        return sum(x[i, j] for i, j in toks) / max(1, len(toks))

    low = np.array([[rho[i, j] < 1 - el and adv[i] < 0 for j in range(t)] for i in range(b)], float)
    high = np.array([[rho[i, j] > 1 + eh and adv[i] > 0 for j in range(t)] for i in range(b)], float)
    region = np.maximum(low, high)
    outside = np.array([[rho[i, j] < 1 - el or rho[i, j] > 1 + eh for j in range(t)] for i in range(b)], float)
    def seq_mean(x):  # plain mean over sequences of a per-sequence value (read at its first loss token)
        return sum(x[i, next(j for j in range(t) if m[i, j] > 0)] for i in nonempty) / num_docs

    avg = tok_mean if cfg.importance_sampling_level == "token" else seq_mean
    a_tok = np.repeat(adv[:, None], t, 1)
    s1 = sum(rho[i, j] for i, j in toks)
    s2 = sum(rho[i, j] ** 2 for i, j in toks)
    out = {
        "advantage": doc_mean(a_tok),
        "advantage_std": std1([adv[i] for i in nonempty]),
        "max_advantage": max((adv[i] for i, _ in toks), default=0.0),
        "min_advantage": min((adv[i] for i, _ in toks), default=0.0),
        "clip_ratio/low_mean": avg(low),
        "clip_ratio/low_min": avg(low),
        "clip_ratio/high_mean": avg(high),
        "clip_ratio/high_max": avg(high),
        "clip_ratio/region_mean": avg(region),
        "clipped_ratio_fraction": doc_mean(outside),
        "ratio_new_old": doc_mean(rho),
        "ratio_new_old_sum": s1,
        "ratio_new_old_squared_sum": s2,
        "kl_new_old": doc_mean(rho - logrho - 1),
        "num_tokens": float(m.sum()),
    }
    if cfg.beta != 0.0:
        out["kl"] = tok_mean(ex["kl"])
    if cfg.metrics == "full":
        out["ess_frac"] = s1**2 / (len(toks) * s2) if toks else 0.0
        out["new_logprobs"] = doc_mean(lp)
        out["old_logprobs"] = doc_mean(old)
        if ent is not None:
            out["entropy"] = tok_mean(ent)
    return out


def sampler_metrics_ref(cfg, *, old, samp, cm, tool=None, trunc=None) -> dict:
    old, samp = f64(old), f64(samp)
    m = loss_mask_ref(cm, tool, trunc, cfg.mask_truncated_completions)
    b, t = m.shape
    toks = [(i, j) for i in range(b) for j in range(t) if m[i, j] > 0]
    present = [(i, j) for i, j in toks if not math.isnan(samp[i, j])]
    diffs = [abs(old[i, j] - samp[i, j]) for i, j in present]
    _, units = is_weights_ref(old, samp, m, cfg.importance_sampling_mode, cfg.importance_sampling_cap, cfg.is_ratio_floor)
    return {
        "sampling/sampling_logp_difference/mean": sum(diffs) / len(diffs) if diffs else 0.0,
        "sampling/sampling_logp_difference/max": max(diffs, default=0.0),
        "sampling/importance_sampling_ratio/min": min(units, default=0.0),
        "sampling/importance_sampling_ratio/mean": sum(units) / len(units) if units else 0.0,
        "sampling/importance_sampling_ratio/max": max(units, default=0.0),
        "sampling/importance_sampling_ratio/frac_masked": sum(u == 0 for u in units) / len(units) if units else 0.0,
        "sampling/frac_missing_logprobs": (len(toks) - len(present)) / len(toks) if toks else 0.0,
    }


def completion_metrics_ref(cm, trunc) -> dict:
    lengths = [float(sum(row)) for row in f64(cm)]
    term = [length for length, tr in zip(lengths, trunc) if not tr]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/mean_terminated_length": sum(term) / len(term) if term else 0.0,
        "completions/min_terminated_length": min(term, default=0.0),
        "completions/max_terminated_length": max(term, default=0.0),
        "completions/clipped_ratio": sum(bool(x) for x in trunc) / len(lengths),
    }
