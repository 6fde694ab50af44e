"""The sampler mode of ``python -m bench`` (``--mode sampler``): ``grpo_fast.sampler_logprobs`` (issue 45) beside the
plain log-prob pass it extends (``grpo_fast.logprobs``), TRL's head and cuBLAS's bare product, no-grad (the old
policy's pass, ``sampler``) and forward + backward (``sampler_fwdbwd``).

The rows (``VARIANTS``): the sampling parameters' path at top_k=50, top_p=0.9 and min_p=0.05 (the kept set by
vLLM's rules: on the Triton backend from the record sweep's tile candidates, with gradients carried to the backward as
kept ids; the rows they leave from chunks of token rows' whole fp32 logits), and replayed kept sets of K=64 and
K=1024 entries (on the Triton backend the log-prob's record sweep reading the sets as bitmaps, with a trained head
its backward layer 1's with the support's term; elsewhere the logits of the K kept entries alone, the full log-prob
by the plain op). ``grpo_fast`` and
``trl`` are the plain log-prob pass, run on the same batch.

The batch (``make_inputs``) is the point's batch (bench/inputs.py: hidden states, lm_head, completion mask) with
targets a sampler could have drawn under every row's parameters: each completion token's target is drawn from the
fp64 softmax restricted to the entries that every measured rule keeps with a margin (``LOGIT_MARGIN``) and that are
among the row's ``TARGET_RANK`` largest logits (so that every replayed set holds it; the top entry always
qualifies). The replayed sets are the spec's kept set at top_p=0.95 (``reference.kept_mask``), its K largest entries
where it has more, in ascending id order, padded with -1.

The truth: the spec's formulas (``reference.logits``, ``reference.kept_mask``; ``reference.sampler_logprobs``'s
lines, kept in fp64) on fp64 logits, in row chunks of the completion tokens. A kept set decided on fp32 logits can
differ from the fp64 one where a logit lies within rounding of its row's threshold (or, for top-p, a mass within
rounding of top_p): such a token (``uncertain``: closer than ``LOGIT_MARGIN`` nats / ``MASS_MARGIN`` of the mass) is
left out of the support's error and gets no support gradient in the timed loss (``support_coef``); the records count
them. The forward + backward's loss is sum_t c_t logp_t + d_t support_t over the completion tokens, c and d drawn
(std 1/n), its fp64 gradients the truth of dH and dW (``references``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import grpo_fast
from bench.inputs import LOGP_ATOL, Inputs, Reference, _active_row_chunks, _finite

F64 = torch.float64
SAMPLER_MODES = ("sampler", "sampler_fwdbwd")
# the rows of the sampler mode: impl name -> sampler_logprobs' sampling parameters, or the replayed sets' width K
VARIANTS = {
    "sampler_top_k": dict(top_k=50),
    "sampler_top_p": dict(top_p=0.9),
    "sampler_min_p": dict(min_p=0.05),
    "sampler_kept64": dict(kept=64),
    "sampler_kept1024": dict(kept=1024),
}
LABELS = {
    "sampler_top_k": "grpo_fast.sampler_logprobs, top_k=50 (no grad: the record sweep's tile candidates; fwd+bwd and "
    "the rows they do not resolve: fp32 rows of logits by cuBLAS)",
    "sampler_top_p": "grpo_fast.sampler_logprobs, top_p=0.9 (parameters' paths, as top_k's)",
    "sampler_min_p": "grpo_fast.sampler_logprobs, min_p=0.05 (parameters' paths, as top_k's)",
    "sampler_kept64": "grpo_fast.sampler_logprobs, replayed kept_ids K=64 (gathered rows + the plain op)",
    "sampler_kept1024": "grpo_fast.sampler_logprobs, replayed kept_ids K=1024",
}
# issue 45's targets: the no-grad pass's time at most this many times the plain log-prob pass's (grpo_fast.logprobs)
TARGETS = {"sampler_top_k": 1.1, "sampler_top_p": 1.5, "sampler_kept64": 1.05, "sampler_kept1024": 1.05}
PLAIN = "plain"  # the references' key of the plain log-prob pass (grpo_fast's and TRL's rows)
TOP_P_OF_REPLAYED = 0.95  # the replayed sets: the spec's kept set at this top_p, truncated to K, padded
LOGIT_MARGIN = 1e-5  # nats: a logit this close to its row's threshold may fall on either side in fp32
MASS_MARGIN = 1e-6  # of the survivors' mass: top-p's cut this close to top_p may fall on either side in fp32


def widths(names):
    """The replayed sets' widths K among the variants ``names``."""
    return sorted({VARIANTS[n]["kept"] for n in names if "kept" in VARIANTS.get(n, {})})


def parameters_of(name) -> dict:
    """The sampling parameters of a variant ({} for replayed sets)."""
    return {k: v for k, v in VARIANTS[name].items() if k != "kept"}


@dataclass
class SamplerInputs(Inputs):
    """A point's batch for the sampler mode: ``Inputs`` with drawable targets (``true_logprobs`` theirs) and, per
    variant, what the timed calls take and the truth they are checked against."""

    kept_ids: dict = field(default_factory=dict)  # K -> [B, T, K] int64 replayed sets, -1 filling
    support_truth: dict = field(default_factory=dict)  # variant -> [B, T] fp64 support log-probs (0 off the mask)
    certain: dict = field(default_factory=dict)  # variant -> [B, T] bool: the fp64 kept set is fp32's too
    kept_sizes: dict = field(default_factory=dict)  # variant -> [B, T] int64 kept set sizes (0 off the mask)
    logp_coef: torch.Tensor | None = None  # c [B, T] fp32: the timed loss's coefficient of logp (0 off the mask)
    support_coef: dict = field(default_factory=dict)  # variant -> d [B, T] fp32 (0 off the mask and where uncertain)
    references: dict = field(default_factory=dict)  # variant or PLAIN -> Reference of the timed loss, fp64

    def sampler_keywords(self, name) -> dict:
        """``sampler_logprobs``' keywords of a variant: its parameters, or its replayed sets."""
        kept = VARIANTS[name].get("kept")
        return dict(kept_ids=self.kept_ids[kept]) if kept else parameters_of(name)

    def stats(self, name) -> dict:
        """A variant's kept sets on the completion tokens (median and largest size; a replayed set's entries) and
        its uncertain tokens, for the record."""
        if name not in self.kept_sizes:
            return {}
        sizes = self.kept_sizes[name][self.mask].float()
        return dict(
            kept_set_median=float(sizes.median()) if sizes.numel() else 0.0,
            kept_set_max=int(sizes.max()) if sizes.numel() else 0,
            uncertain_tokens=int((self.mask & ~self.certain[name]).sum()),
        )


def spec_rows(z, targets, name=None, kept_rows=None):
    """(logp, support) [n] of fp64 logits rows ``z`` [n, V] at ``targets`` [n]: ``reference.sampler_logprobs``' lines
    in fp64 (its last cast to fp32 left out); ``name`` None: the plain log-prob alone (support None). Differentiable
    in z (the kept set from z detached, as the spec)."""
    target = z.gather(-1, targets[:, None]).squeeze(-1)
    logp = target - torch.logsumexp(z, dim=-1)
    if name is None:
        return logp, None
    if kept_rows is None:
        keep = grpo_fast.reference.kept_mask(z.detach(), **parameters_of(name))
    else:
        columns = torch.where(kept_rows >= 0, kept_rows, z.shape[-1])
        keep = torch.zeros((z.shape[0], z.shape[-1] + 1), dtype=torch.bool, device=z.device)
        keep = keep.scatter(-1, columns, True)[:, :-1]
    support = target - torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)
    return logp, torch.where(keep.gather(-1, targets[:, None]).squeeze(-1), support, math.nan)


def certain_rows(z, params) -> torch.Tensor:
    """[n] bool: whether the kept set of fp64 rows ``z`` under one rule of ``params`` stays the same for every logit
    moved by less than LOGIT_MARGIN and, for top-p, every survivor mass above by less than MASS_MARGIN."""
    values = z.sort(dim=-1, descending=True).values
    n, V = values.shape
    inf = values.new_full((n,), math.inf)
    if params.get("top_k"):
        k = params["top_k"]
        return values[:, k - 1] - values[:, k] > LOGIT_MARGIN if k < V else inf > 0
    if params.get("min_p"):
        cut = values[:, :1] + math.log(params["min_p"])
        return (values - cut).abs().amin(-1) > LOGIT_MARGIN
    top_p = params["top_p"]
    q = torch.softmax(values, dim=-1)
    above = q.cumsum(-1) - q
    last = ((above < top_p).sum(-1) - 1).clamp(min=0)[:, None]  # the top entry is always kept
    after = (last + 1).clamp(max=V - 1)
    beyond = last < V - 1
    mass_gap = torch.minimum(
        top_p - above.gather(-1, last), torch.where(beyond, above.gather(-1, after) - top_p, math.inf)
    )
    logit_gap = torch.where(beyond, values.gather(-1, last) - values.gather(-1, after), math.inf)
    return ((mass_gap > MASS_MARGIN) & (logit_gap > LOGIT_MARGIN)).squeeze(-1)


def make_inputs(x: Inputs, names, grads=True, seed=0) -> SamplerInputs:
    """The sampler mode's batch from the point's ``x`` (module docstring): targets drawn for every variant of
    ``VARIANTS`` (whichever are timed: one batch for every row), the replayed sets, the truth of the variants
    ``names`` (and PLAIN) and, with ``grads``, the fp64 gradients of their timed losses."""
    D, V, device = x.D, x.V, x.hidden.device
    h = x.hidden.detach().reshape(-1, D)
    w64 = x.weight.detach().double()
    n_all = x.N
    g = torch.Generator(device=device).manual_seed(seed + 7)
    targets = x.targets.reshape(-1).clone()
    logp = torch.zeros(n_all, dtype=F64, device=device)
    variants = [n for n in VARIANTS if n in names]
    parameter_variants = [n for n in VARIANTS if "kept" not in VARIANTS[n]]
    support = {n: torch.zeros(n_all, dtype=F64, device=device) for n in variants}
    certain = {n: torch.ones(n_all, dtype=torch.bool, device=device) for n in variants}
    sizes = {n: torch.zeros(n_all, dtype=torch.int64, device=device) for n in variants}
    ks = widths(VARIANTS)
    kept = {K: torch.full((n_all, K), -1, dtype=torch.int64, device=device) for K in ks}
    rank = min(ks)
    chunks = _active_row_chunks(x.mask, V)
    with torch.no_grad():
        for rows in chunks:
            z = grpo_fast.reference.logits(h[rows], w64, None, x.temperature, compute_dtype=F64)
            # the targets: inside every rule's kept set by LOGIT_MARGIN, among the `rank` largest; the top always
            drawable = torch.zeros_like(z, dtype=torch.bool).scatter_(1, z.topk(min(rank, V), dim=-1).indices, True)
            keeps = {}
            for name in parameter_variants:
                keeps[name] = grpo_fast.reference.kept_mask(z, **parameters_of(name))
                tau = torch.where(keeps[name], z, math.inf).amin(-1, keepdim=True)
                drawable &= z >= tau + LOGIT_MARGIN
            drawable.scatter_(1, z.argmax(-1, keepdim=True), True)
            y = torch.multinomial(torch.softmax(z.masked_fill(~drawable, -math.inf), dim=-1), 1, generator=g)[:, 0]
            targets[rows] = y
            logp[rows] = spec_rows(z, y)[0]
            keep95 = grpo_fast.reference.kept_mask(z, top_p=TOP_P_OF_REPLAYED)
            for K in ks:
                values, ids = z.masked_fill(~keep95, -math.inf).topk(min(K, V), dim=-1)
                ids = torch.where(values > -math.inf, ids, V).sort(dim=-1).values  # ascending ids, the filling last
                kept[K][rows, : ids.shape[1]] = torch.where(ids < V, ids, -1)
            for name in variants:
                K = VARIANTS[name].get("kept")
                s = spec_rows(z, y, name, kept[K][rows] if K else None)[1]
                if not bool(torch.isfinite(s).all()):
                    raise RuntimeError(f"{name}: a drawn target is outside its fp64 kept set")
                support[name][rows] = s
                if K:
                    sizes[name][rows] = (kept[K][rows] >= 0).sum(-1)
                else:
                    sizes[name][rows] = keeps[name].sum(-1)
                    certain[name][rows] = certain_rows(z, parameters_of(name))
            del z, drawable, keeps, keep95
    shape = x.targets.shape
    mask = x.mask
    n = max(1, int(mask.sum()))
    logp_coef = torch.randn(shape, generator=g, device=device) / n * mask
    support_coef = {
        name: torch.randn(shape, generator=g, device=device) / n * (mask & certain[name].view(shape))
        for name in variants
    }
    out = SamplerInputs(
        **{f: getattr(x, f) for f in Inputs.__dataclass_fields__},
        kept_ids={K: ids.view(*shape, K) for K, ids in kept.items()},
        support_truth={k: v.view(shape) for k, v in support.items()},
        certain={k: v.view(shape) for k, v in certain.items()},
        kept_sizes={k: v.view(shape) for k, v in sizes.items()},
        logp_coef=logp_coef,
        support_coef=support_coef,
    )
    out.__dict__.update({k: x.__dict__[k] for k in ("temperature", "options") if k in x.__dict__})  # overrides
    out.targets = targets.view(shape)
    out.true_logprobs = logp.view(shape)
    if grads:
        for name in [PLAIN] + variants:
            out.references[name] = reference_of(out, None if name == PLAIN else name)
    return out


def reference_of(x: SamplerInputs, name=None) -> Reference:
    """The fp64 loss sum_t c_t logp_t (+ d_t support_t for a variant ``name``) over the completion tokens and its
    gradients of hidden and weight (on the CPU), in row chunks."""
    D = x.D
    h, t = x.hidden.detach().reshape(-1, D), x.targets.reshape(-1)
    c = x.logp_coef.reshape(-1).double()
    d = x.support_coef[name].reshape(-1).double() if name is not None else None
    K = VARIANTS[name].get("kept") if name is not None else None
    kept = x.kept_ids[K].reshape(-1, K) if K else None
    w64 = x.weight.detach().double().requires_grad_()
    grad_hidden = torch.zeros(x.N, D, dtype=F64, device=h.device)
    loss = 0.0
    for rows in _active_row_chunks(x.mask, x.V):
        hc = h[rows].double().requires_grad_()
        z = grpo_fast.reference.logits(hc, w64, None, x.temperature, compute_dtype=F64)
        lp, sp = spec_rows(z, t[rows], name, kept[rows] if kept is not None else None)
        total = (lp * c[rows]).sum()
        if sp is not None:
            total = total + (torch.nan_to_num(sp) * d[rows]).sum()
        total.backward()
        loss += float(total.detach())
        grad_hidden[rows] = hc.grad
        del hc, z, lp, sp, total
    grad_weight = w64.grad if w64.grad is not None else torch.zeros_like(w64)
    return Reference(
        loss=loss,
        grad_hidden=grad_hidden.view(x.B, x.T, D).cpu(),
        grad_weight=grad_weight.cpu(),
        grad_hidden_scale=float(grad_hidden.abs().max()),
        grad_weight_scale=float(grad_weight.abs().max()),
    )


def reference_key(impl_name) -> str:
    """The references' key of an implementation's row: its variant, else the plain pass (grpo_fast, TRL)."""
    return impl_name if impl_name in VARIANTS else PLAIN


def check(out, x: SamplerInputs, impl_name, dtype):
    """(ok, errors) of a no-grad row against the fp64 truth, on the completion tokens: the log-probs' max |error|
    and, for a variant, the support log-probs' (over its certain tokens; over every one as ``support_all``) in nats,
    and its uncertain tokens. ``out``: a [B, T] tensor (the plain pass) or a ``SamplerLogprobs``."""
    logp, support = (out, None) if isinstance(out, torch.Tensor) else (out.logprobs, out.support_logprobs)
    if logp is None or tuple(logp.shape) != (x.B, x.T):
        return False, {"logprobs_max_abs_err": None}
    mask = x.mask

    def worst(a, b, where):
        diff = (a.detach().double() - b)[where]
        return float(diff.abs().max()) if diff.numel() else 0.0

    errors = {"logprobs_max_abs_err": worst(logp, x.true_logprobs, mask)}
    ok = _finite(errors["logprobs_max_abs_err"]) and errors["logprobs_max_abs_err"] <= LOGP_ATOL[dtype]
    if impl_name in VARIANTS:
        if support is None or tuple(support.shape) != (x.B, x.T):
            return False, dict(errors, support_max_abs_err=None)
        truth, certain = x.support_truth[impl_name], x.certain[impl_name]
        errors["support_max_abs_err"] = worst(support, truth, mask & certain)
        errors["support_all_max_abs_err"] = worst(support, truth, mask)
        errors["uncertain_tokens"] = int((mask & ~certain).sum())
        ok = ok and _finite(errors["support_max_abs_err"]) and errors["support_max_abs_err"] <= LOGP_ATOL[dtype]
    return ok, errors


# ----------------------------------------------------------------------------------------------- the rows
def build_variant(name):
    """A variant's bench function builder: ``sampler_logprobs`` with its parameters or replayed sets, no-grad (mode
    ``sampler``: the SamplerLogprobs) or the loss sum c logp + d support (mode ``sampler_fwdbwd``)."""

    def build(mode, options):
        backend = options.get("backend", "auto")

        def call(x, w):
            return grpo_fast.sampler_logprobs(
                x.hidden, w, x.targets, x.mask, temperature=x.temperature, backend=backend, **x.sampler_keywords(name)
            )

        if mode == "sampler":

            def old_policy_pass(x, w):
                with torch.no_grad():
                    return call(x, w)

            return old_policy_pass

        def loss(x, w):
            out = call(x, w)
            return (out.logprobs * x.logp_coef).sum() + (out.support_logprobs * x.support_coef[name]).sum()

        return loss

    return build


def plain_loss(logp, x: SamplerInputs):
    """The plain pass's timed loss: sum_t c_t logp_t."""
    return (logp * x.logp_coef).sum()


# ----------------------------------------------------------------------------------------------- the report
def sampler_meta() -> dict:
    """The sampler mode's settings, for the results' metadata."""
    return dict(
        variants=VARIANTS,
        targets_x_plain_logprobs=TARGETS,
        replayed_sets=f"the spec's kept set at top_p={TOP_P_OF_REPLAYED} (fp64), its K largest entries, ascending ids, "
        "-1 filling",
        targets=f"drawn from the fp64 softmax over the entries every rule keeps by {LOGIT_MARGIN:g} nats and among "
        f"each row's {min(widths(VARIANTS))} largest logits",
        uncertain_tokens=f"a logit within {LOGIT_MARGIN:g} nats of its row's threshold, or top-p's cut within "
        f"{MASS_MARGIN:g} of the mass: left out of the support's error, no support gradient in the timed loss",
        loss="sum_t c_t logp_t + d_t support_t over the completion tokens, c, d ~ N(0, 1) / n (the plain pass: c only)",
    )


def target_rows(doc) -> list[dict]:
    """Issue 45's targets at each point: the no-grad pass of each variant with a target against the plain log-prob
    pass measured in the same run; PASS / FAIL on a GPU, 'not evaluated' on a CPU (the targets are a GPU's)."""
    cuda = doc["meta"].get("device_type") == "cuda"
    out = []
    for r in doc["results"]:
        if r["mode"] != "sampler" or r["impl"] not in TARGETS:
            continue
        target = TARGETS[r["impl"]]
        ratio = r.get("ratio_time_vs_plain")
        if r["status"] != "ok" or ratio is None:
            result = "not measured"
            note = f"{r['status']}" + (f": {r['reason']}" if r.get("reason") else "") if r["status"] != "ok" else ""
            note = note or "the plain pass (grpo_fast) has no time at this point"
        elif not cuda:
            result, note = "not evaluated", "CPU run: the targets are for a GPU (its chunked torch path here)"
        else:
            result, note = ("PASS" if ratio <= target else "FAIL"), ""
        out.append(
            dict(
                shape=r["shape"],
                N=r["N"],
                scenario=r["scenario"],
                impl=r["impl"],
                target=target,
                measured=ratio,
                result=result,
                note=note,
            )
        )
    return out
