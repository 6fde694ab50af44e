"""grpo_fast.loss and the spec against TRL 1.16.0's own ``GRPOTrainer._compute_loss``, on a tiny random Qwen2 built
offline.

One trainer (tests/trl_harness.py) serves the module: each case sets the trainer attributes ``_compute_loss`` reads
for its ``GRPOConfig`` options (``set_loss_options`` asserts each exists), runs TRL's loss and backward through the
whole model, then runs ``grpo_fast.loss`` on the backbone's last hidden states and ``lm_head.weight`` with the same
options (the keyword names are GRPOConfig's) and backward through the same model. Compared, in fp32: the loss, the
gradient of every parameter of the model, and every metric both report.

The batch comes from TRL's own ``_generate_and_score_completions`` on a scripted rollout (left-padded prompts, a
completion masked out entirely as truncated, a one-token completion, sampler log-probs with NaN where "vLLM" could
not score a token), so the padding, masks, ``num_items_in_batch`` and the four vLLM importance-sampling ratios are
TRL's; old / ref log-probs are the model's own plus noise (clipping happens, the KL is not zero), advantages are set
by hand (one exactly 0: the A >= 0 / A > 0 boundaries of vespo, sapo and the off-policy mask).

Both grpo_fast backends run: "torch" (the chunked-torch CPU path) and "triton" (the kernels, under TRITON_INTERPRET=1
as tests/conftest.py sets it), and beside them the spec (``grpo_fast.reference.loss``, full logits, its own metric
reducers), so that the truth the product is tested against is itself TRL's.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import trl
from trl import GRPOConfig
from trl_harness import (
    ASCII_EOS_ID,
    ASCII_VOCAB_SIZE,
    ascii_tokenizer,
    build_trainer,
    grpo_config,
    loss_option_defaults,
    reset_loss_options,
    score_scripted_rollout,
    set_loss_options,
    tiny_gemma2,
    tiny_qwen2,
)

import grpo_fast
from grpo_fast import reference

# TRL's models here are CPU models: the Triton backend runs on them under the interpreter
BACKENDS = ("torch", pytest.param("triton", marks=pytest.mark.interpreter_only))
# what is compared with TRL's loss, gradients and metrics: the spec ("reference") and both backends
SIDES = ("reference", *BACKENDS)
# dr_grpo divides by B * max_completion_length: 11, not the padded completion length 8, so using T would fail
MAX_COMPLETION_LENGTH = 11
# GRPOConfig options that exist for TRL's vLLM importance sampling, not grpo_fast.loss keywords (grpo_fast takes the
# resulting weights as importance_weights, from grpo_fast.sampling_importance_weights)
TRL_ONLY_OPTIONS = (
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "use_adaptive_entropy",
)
# Metrics one side reports that the other has no counterpart for. TRL's `entropy_coef` is trainer state (the
# coefficient itself, logged when the bonus is on), not computed from the batch; grpo_fast's `ratio_mean` is its own.
TRL_ONLY_METRICS = {"entropy_coef"}
GRPO_FAST_ONLY_METRICS = {"ratio_mean"}

# fp32 tolerances: 1e-5 relative, the parity we promise. TRL's chunked log-softmax and grpo_fast's online logsumexp
# sum the same fp32 numbers in other orders, so each log-prob / entropy differs by a few ulps (~1e-7 relative); a loss,
# metric or gradient entry that is a sum of terms of both signs can be ~0 while its terms are not, and then its own
# relative error is unbounded. So the 1e-5 is also allowed relative to the size of the terms summed: ATOL for the loss
# and the metrics, whose terms are O(0.1 - 1) here (the worst seen: 4e-8 on a loss of 7e-4 that cancels), and for a
# gradient entry RTOL times the largest entry of that module's gradient (weight and bias together: a Linear's bias
# gradient sums the same per-token terms as its weight's; k_proj's nearly cancels, softmax being blind to a shift of
# a query's scores but for RoPE). The worst seen is 1.5e-6 of the module's largest entry, with vespo under the
# interpreter: phi = exp(lam + k log W - lam W) multiplies a log-prob's ulp difference by |k - lam W| per token.
RTOL = 1e-5
ATOL = 1e-6

# ----------------------------------------------------------------------------------------------- the batch
# Three groups of num_generations=2. Row 3 ends without EOS: TRL masks it out entirely (mask_truncated_completions);
# row 2 is EOS alone: a one-token completion. Prompts of different lengths are left-padded by TRL.
PROMPT_IDS = [[72, 105, 33], [72, 105, 33], [50, 43, 50, 61, 63, 10], [50, 43, 50, 61, 63, 10], [81, 58], [81, 58]]
EOS = ASCII_EOS_ID
COMPLETION_IDS = [
    [52, 32, 52, 61, 56, 46, 32, EOS],
    [53, 33, 10, EOS],
    [EOS],
    [9, 8, 7, 6, 5],
    [100, 101, 102, 103, 104, 105, EOS],
    [120, 121, EOS],
]
ADVANTAGES = [0.8, -1.1, 0.0, 0.6, -0.7, 1.3]
# per-row offset of the sampler's log-probs from the model's: row 1 (A < 0) is far off-policy (dropped by the
# off-policy mask at OFF_POLICY_THRESHOLD), row 4 (A < 0) is close (kept)
SAMPLER_OFFSET = [0.1, 0.6, -0.2, 0.3, -0.4, 0.2]
OFF_POLICY_THRESHOLD = 0.2
NAN_POSITIONS = [(0, 2), (1, 0), (4, 3)]  # tokens the sampler could not score (row 4's is given as None, as vLLM)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# the tiny Qwen2's sizes besides its vocabulary
TINY_QWEN2 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def make_trainer(model=None, **config):
    """TRL's GRPOTrainer around a tiny Qwen2 (hidden 32, vocab 131: the interpreter's cost grows with D x V)."""
    if model is None:
        model = tiny_qwen2(vocab_size=ASCII_VOCAB_SIZE, **TINY_QWEN2)
    args = grpo_config(
        per_device_train_batch_size=6,
        num_generations=2,
        max_completion_length=MAX_COMPLETION_LENGTH,
        mask_truncated_completions=True,
        **config,
    )
    trainer = build_trainer(args, model=model, processing_class=ascii_tokenizer())
    _assert_trl_head(trainer)
    return trainer


@pytest.fixture(scope="module")
def trainer():
    return make_trainer()


def _assert_trl_head(trainer):
    """The model's forward must be TRL 1.16's own fused head (not grpo_fast's, which grpo_fast.trl provides)."""
    assert trl.__version__.startswith("1.16."), f"this module checks TRL 1.16's loss, found trl {trl.__version__}"
    assert type(trainer) is trl.GRPOTrainer
    code = trainer.model.forward.__func__.__code__
    assert code.co_name == "_fused_forward" and code.co_filename.endswith("trl/trainer/utils.py"), code


def _sampler_logprobs(old_true):
    g = torch.Generator().manual_seed(11)
    rows = []
    for b, completion in enumerate(COMPLETION_IDS):
        n = len(completion)
        rows.append((old_true[b, :n] + SAMPLER_OFFSET[b] + 0.6 * torch.randn(n, generator=g)).tolist())
    for b, t in NAN_POSITIONS:
        rows[b][t] = None if b == 4 else math.nan
    return rows


@pytest.fixture(scope="module")
def rollouts(trainer):
    return make_rollouts(trainer)


@pytest.fixture(scope="module")
def batch(rollouts):
    return make_batch(rollouts)


# (clip_max, clip_min): TRL's default, both, a lower bound alone, a lower bound above 1 (which TRL applies to padding)
CLIPS = ((3.0, None), (2.0, 0.5), (None, 0.7), (3.0, 1.2))


def make_rollouts(trainer, clips=CLIPS):
    """TRL's inputs for the scripted rollout, per (vLLM importance sampling mode, clip_max, clip_min)."""
    # the model's own log-probs first (TRL computes them as the old log-probs when correcting for a sampler)
    old_true = score_scripted_rollout(trainer, PROMPT_IDS, COMPLETION_IDS, [[0.0] * len(c) for c in COMPLETION_IDS])[
        "old_per_token_logps"
    ]
    sampling = _sampler_logprobs(old_true)
    out = {}
    for mode in IS_MODES:
        for clip_max, clip_min in clips:
            if mode.endswith("truncate") and clip_max is None:
                continue  # a lower bound alone: checked on the mask modes only (keeps the grid small)
            out[mode, clip_max, clip_min] = score_scripted_rollout(
                trainer,
                PROMPT_IDS,
                COMPLETION_IDS,
                sampling,
                vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_max=clip_max,
                vllm_importance_sampling_clip_min=clip_min,
            )
    return out


def make_batch(rollouts):
    """The loss tests' batch: TRL's tensors, plus noisy old / ref log-probs and hand-set advantages."""
    base = rollouts["token_truncate", 3.0, None]
    mask = base["completion_mask"]
    assert mask.shape == (6, 8) and mask.sum(1).tolist() == [8, 4, 1, 0, 7, 3]
    assert int(base["num_items_in_batch"]) == 23
    g = torch.Generator().manual_seed(5)
    true = base["old_per_token_logps"]
    advantages_per_token = torch.randn(6, 8, generator=g)
    advantages_per_token[0, 1] = advantages_per_token[5, :] = 0.0
    return dict(
        inputs={
            k: base[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch")
        },
        old=((true + 0.3 * torch.randn(6, 8, generator=g)) * mask),
        ref=((true + 0.3 * torch.randn(6, 8, generator=g)) * mask),
        sampling=base["sampling_per_token_logps"],
        advantages=torch.tensor(ADVANTAGES),
        advantages_per_token=advantages_per_token,
        true=true,  # the model's own log-probs (TRL's old_per_token_logps under the sampler correction)
        ratios={mode: rollouts[mode, 3.0, None]["importance_sampling_ratio"] for mode in IS_MODES},
    )


# ----------------------------------------------------------------------------------------------- the two sides
@dataclasses.dataclass
class Case:
    """One loss configuration: GRPOConfig options (the names of grpo_fast.loss's keywords) and how the batch is fed."""

    id: str
    options: dict = dataclasses.field(default_factory=dict)
    on_policy: bool = False  # no old log-probs: TRL's num_iterations=1 path (per_token_logps.detach())
    sampler: bool = False  # sampling_per_token_logps in the inputs (the off-policy mask reads them)
    is_mode: str | None = None  # vLLM importance sampling ratio of this mode in the inputs, correction on
    weights_1d: bool = False  # grpo_fast gets a sequence-level ratio as [B] instead of TRL's [B, 1]
    per_token_advantages: bool = False
    num_items_in_batch: int | None = None  # None: TRL's (the mask sum) and grpo_fast's default; else an int64 tensor

    def trl_inputs(self, batch):
        inputs = dict(batch["inputs"])
        inputs["advantages"] = batch["advantages_per_token" if self.per_token_advantages else "advantages"]
        if not self.on_policy:
            inputs["old_per_token_logps"] = batch["old"]
        if self.options.get("beta", 0.0) != 0.0:
            inputs["ref_per_token_logps"] = batch["ref"]
        if self.sampler:
            inputs["sampling_per_token_logps"] = batch["sampling"]
        if self.is_mode is not None:
            inputs["importance_sampling_ratio"] = batch["ratios"][self.is_mode]
        if self.num_items_in_batch is not None:
            inputs["num_items_in_batch"] = torch.tensor(self.num_items_in_batch)
        return inputs

    def trl_options(self):
        options = dict(self.options)
        if self.is_mode is not None:
            options.update(
                use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=self.is_mode
            )
        return options

    def grpo_fast_kwargs(self, inputs):
        kw = {k: v for k, v in self.options.items() if k not in TRL_ONLY_OPTIONS}
        kw["old_logprobs"] = inputs.get("old_per_token_logps")
        kw["ref_logprobs"] = inputs.get("ref_per_token_logps")
        kw["sampling_logprobs"] = inputs.get("sampling_per_token_logps")
        weights = inputs.get("importance_sampling_ratio")
        if weights is not None and self.weights_1d:
            weights = weights.squeeze(1)
        kw["importance_weights"] = weights
        if self.num_items_in_batch is not None:
            kw["num_items_in_batch"] = inputs["num_items_in_batch"]
        return kw


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_trl(trainer, case, inputs, reset=True):
    """TRL's loss, every parameter's gradient and its logged metrics ({name: float}, each logged once).

    The trainer's loss options are the case's, on top of GRPOConfig's defaults (``reset``) or of its own config.
    """
    if reset:
        reset_loss_options(trainer)
    set_loss_options(trainer, **case.trl_options())
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    metrics = {}
    for name, values in trainer._metrics["train"].items():
        assert len(values) == 1, (name, values)
        metrics[name] = float(values[0])
    trainer._metrics["train"].clear()
    if reset:
        reset_loss_options(trainer)
    return loss.detach(), _grads(model), metrics


def run_grpo_fast(model, inputs, backend, **kwargs):
    """grpo_fast.loss (or with ``backend="reference"`` the spec's) from the backbone's last hidden states (hidden[b, t]
    predicts completion_ids[b, t]) and the lm_head, backward through the model: the loss, every parameter's gradient,
    the metrics ({name: float})."""
    model.zero_grad(set_to_none=True)
    prompt_len = inputs["prompt_ids"].shape[1]
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # as TRL's forward
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[
        :, prompt_len - 1 : -1
    ]
    head = model.get_output_embeddings()
    if backend == "reference":
        loss_fn = reference.loss
    else:
        loss_fn, kwargs = grpo_fast.loss, dict(kwargs, backend=backend)
    loss, metrics = loss_fn(
        hidden,
        head.weight,
        inputs["completion_ids"],
        inputs["advantages"],
        inputs["completion_mask"],
        bias=head.bias,
        **kwargs,
    )
    loss.backward()
    return loss.detach(), _grads(model), {k: float(v) for k, v in metrics.items()}


def assert_matches_trl(trl_result, fast_result, context=""):
    (trl_loss, trl_grads, trl_metrics), (loss, grads, metrics) = trl_result, fast_result
    torch.testing.assert_close(loss, trl_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{context} loss: {m}")
    assert set(grads) == set(trl_grads), f"{context}: parameters with a gradient differ"
    scale = {}  # the largest gradient entry of each module (a Linear's weight and bias together)
    for name, expected in trl_grads.items():
        module = name.rsplit(".", 1)[0]
        scale[module] = max(scale.get(module, 0.0), float(expected.abs().max()))
    for name, expected in trl_grads.items():
        atol = RTOL * scale[name.rsplit(".", 1)[0]]
        torch.testing.assert_close(
            grads[name], expected, rtol=RTOL, atol=atol, msg=lambda m, name=name: f"{context} grad of {name}: {m}"
        )
    # every metric TRL logs has a grpo_fast counterpart, and the other way round (bar the named exceptions)
    names = f"{context}: TRL logs {sorted(trl_metrics)}, grpo_fast reports {sorted(metrics)}"
    assert set(trl_metrics) - TRL_ONLY_METRICS <= set(metrics), names
    assert set(metrics) - GRPO_FAST_ONLY_METRICS <= set(trl_metrics), names
    for name in set(trl_metrics) & set(metrics):
        expected, actual = trl_metrics[name], metrics[name]
        both_nan = math.isnan(actual) and math.isnan(expected)
        assert both_nan or math.isclose(actual, expected, rel_tol=RTOL, abs_tol=ATOL), (
            f"{context} metric {name}: grpo_fast {actual!r}, TRL {expected!r}"
        )


_TRL_RESULTS = {}  # case id -> TRL's result: computed once for both backends


def check_case(trainer, batch, case, backend):
    inputs = case.trl_inputs(batch)
    if case.id not in _TRL_RESULTS:
        _TRL_RESULTS[case.id] = run_trl(trainer, case, inputs)
    trl_result = _TRL_RESULTS[case.id]
    fast_result = run_grpo_fast(trainer.model, inputs, backend, **case.grpo_fast_kwargs(inputs))
    assert_matches_trl(trl_result, fast_result, f"[{case.id}, {backend}]")
    return trl_result


# ----------------------------------------------------------------------------------------------- the cases
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")


def _grid(prefix, **options):
    return [
        Case(f"{prefix}-{lt}-{lvl}", dict(loss_type=lt, importance_sampling_level=lvl, **options))
        for lt in LOSS_TYPES
        for lvl in LEVELS
    ]


CASES = [
    # every loss type x importance level at TRL's defaults (beta 0), then with the KL (use_bias_correction_kl: True)
    *_grid("defaults"),
    *_grid("beta", beta=0.04),
    # on-policy (no old log-probs, TRL's default num_iterations=1): ratio exactly 1, vespo's phi(1) = 1
    *[Case(f"on_policy-{lt}", dict(loss_type=lt, beta=0.04), on_policy=True) for lt in ("dapo", "cispo", "vespo")],
    Case("on_policy-grpo-sequence", dict(loss_type="grpo", importance_sampling_level="sequence"), on_policy=True),
    # use_bias_correction_kl off
    *[
        Case(
            f"no_bias_correction-{lt}-{lvl}",
            dict(loss_type=lt, importance_sampling_level=lvl, beta=0.04, use_bias_correction_kl=False),
        )
        for lt, lvl in (("dapo", "token"), ("grpo", "sequence"), ("vespo", "token"))
    ],
    # off-policy sequence mask: from the sampler's log-probs (with NaN), and from the old ones (no sampler)
    *[
        Case(
            f"off_policy-{lt}-{lvl}",
            dict(loss_type=lt, importance_sampling_level=lvl, off_policy_mask_threshold=OFF_POLICY_THRESHOLD),
            sampler=True,
        )
        for lt, lvl in (
            ("dapo", "token"),
            ("grpo", "sequence"),
            ("cispo", "token"),
            ("sapo", "token"),
            ("vespo", "token"),
        )
    ],
    Case("off_policy-no_sampler-bnpo", dict(loss_type="bnpo", off_policy_mask_threshold=0.0)),
    # top-entropy tokens only
    *[
        Case(f"top_entropy-{lt}-{lvl}", dict(loss_type=lt, importance_sampling_level=lvl, top_entropy_quantile=0.2))
        for lt, lvl in (("dapo", "token"), ("grpo", "sequence"), ("cispo", "token"), ("luspo", "sequence"))
    ],
    # entropy bonus, alone and on the top-entropy tokens
    *[Case(f"entropy_coef-{lt}", dict(loss_type=lt, entropy_coef=0.01)) for lt in ("dapo", "grpo", "vespo")],
    Case(
        "entropy_coef-top_entropy-grpo-sequence",
        dict(loss_type="grpo", importance_sampling_level="sequence", entropy_coef=0.05, top_entropy_quantile=0.3),
    ),
    # vLLM importance sampling: TRL's ratios of each mode ([B, T] token_*, [B, 1] sequence_*)
    *[
        Case(f"is-{mode}-{lt}-{lvl}", dict(loss_type=lt, importance_sampling_level=lvl), is_mode=mode)
        for mode in IS_MODES
        for lt, lvl in (("dapo", "token"), ("grpo", "sequence"))
    ],
    *[
        Case(f"is-{mode}-{lt}", dict(loss_type=lt, beta=0.04), is_mode=mode)
        for mode in IS_MODES
        for lt in ("cispo", "sapo")
    ],
    *[Case(f"is-{mode}-vespo", dict(loss_type="vespo"), is_mode=mode) for mode in ("token_truncate", "token_mask")],
    Case("is-sequence_mask-as-[B]-luspo", dict(loss_type="luspo"), is_mode="sequence_mask", weights_1d=True),
    # delta (two-sided clipping), epsilon / epsilon_high
    # (delta bites where A < 0 and the ratio is above both delta and 1 + epsilon_high: the sequence ratios here are
    # within [0.84, 1.17], so the sequence case narrows the clip range)
    *[
        Case(f"delta-{lt}-{lvl}", dict(loss_type=lt, importance_sampling_level=lvl, **clip))
        for lt, lvl, clip in (
            ("dapo", "token", dict(delta=1.1)),
            ("luspo", "token", dict(delta=1.1)),
            ("grpo", "sequence", dict(delta=1.08, epsilon=0.05)),
        )
    ],
    *[Case(f"epsilon-{lt}", dict(loss_type=lt, epsilon=0.1, epsilon_high=0.28)) for lt in ("dapo", "bnpo")],
    Case("epsilon_high-cispo", dict(loss_type="cispo", epsilon_high=1.2)),
    # temperature (TRL's fused head re-patched, as its __init__ does; see also test_temperature_repatch_is_faithful)
    *[
        Case(f"temperature-{lt}-{lvl}", dict(loss_type=lt, importance_sampling_level=lvl, temperature=0.7, beta=0.04))
        for lt, lvl in (("dapo", "token"), ("grpo", "sequence"), ("vespo", "token"))
    ],
    # per-token advantages [B, T]
    *[
        Case(
            f"per_token_advantages-{lt}-{lvl}",
            dict(loss_type=lt, importance_sampling_level=lvl),
            per_token_advantages=True,
        )
        for lt, lvl in (
            ("dapo", "token"),
            ("grpo", "sequence"),
            ("cispo", "sequence"),
            ("sapo", "token"),
            ("vespo", "token"),
            ("luspo", "sequence"),
        )
    ],
    # num_items_in_batch of a larger accumulation window (dapo, cispo, vespo normalise by it)
    *[Case(f"num_items_in_batch-{lt}", dict(loss_type=lt), num_items_in_batch=57) for lt in ("dapo", "cispo", "vespo")],
    # max_completion_length (dr_grpo's normaliser), sapo temperatures, vespo's gamma parameters
    Case("max_completion_length-dr_grpo", dict(loss_type="dr_grpo", max_completion_length=30)),
    Case("sapo_temperatures", dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    Case(
        "vespo_parameters",
        dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=4.0, vespo_lambda_neg=2.5),
    ),
    # every option at once
    *[
        Case(
            f"everything-{lt}-{lvl}",
            dict(
                loss_type=lt,
                importance_sampling_level=lvl,
                beta=0.04,
                temperature=0.9,
                off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
                top_entropy_quantile=0.5,
                entropy_coef=0.02,
                use_bias_correction_kl=lvl == "token",
                vespo_k_pos=2.5,
                vespo_lambda_neg=1.5,
                **(
                    dict(epsilon=0.15, epsilon_high=0.25, delta=1.3)
                    if lvl == "token"
                    else dict(epsilon=0.05, epsilon_high=0.08, delta=1.06)
                ),
            ),
            sampler=True,
            is_mode="token_mask",
            per_token_advantages=True,
            num_items_in_batch=40,
        )
        for lt, lvl in (("dapo", "token"), ("grpo", "sequence"), ("vespo", "token"))
    ],
]
assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("backend", SIDES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_loss_matches_trl(trainer, batch, case, backend):
    check_case(trainer, batch, case, backend)


# ----------------------------------------------------------------------------------------------- non-vacuity
def test_the_batch_exercises_every_branch(batch, rollouts):
    """The cases above would pass vacuously if nothing were clipped, masked or dropped: check that it is."""
    mask = batch["inputs"]["completion_mask"].bool()
    advantages = batch["advantages"].unsqueeze(1)
    # the off-policy mask (TRL's own) drops a negative-advantage sequence and keeps another
    keep = trl.GRPOTrainer.get_off_policy_mask(
        advantages, batch["old"], batch["sampling"], mask.float(), OFF_POLICY_THRESHOLD
    ).squeeze(1)
    negative = (advantages.squeeze(1) < 0) & mask.any(1)
    assert (keep[negative] == 0).any() and (keep[negative] == 1).any()
    assert torch.isnan(batch["sampling"][mask]).any()
    # token ratios on both sides of the clip range (epsilon 0.2)
    ratio = torch.exp(batch["true"] - batch["old"])[mask]
    assert (ratio < 0.8).any() and (ratio > 1.2).any()
    # importance ratios truncated at clip_max and masked to 0
    for mode in IS_MODES:
        r = batch["ratios"][mode]
        assert (r == 3.0).any() if mode.endswith("truncate") else (r == 0.0).any(), mode
    # TRL's ratio at padding is exp(0) = 1, clamped to clip_min when that is above 1 (see the VESPO test below)
    padding = ~mask
    assert (rollouts["token_truncate", 3.0, 1.2]["importance_sampling_ratio"][padding] == 1.2).all()
    assert (batch["ratios"]["token_truncate"][padding] == 1.0).all()


# ----------------------------------------------------------------------------------------------- sampler weights
@pytest.mark.parametrize(
    "key", [(m, hi, lo) for m in IS_MODES for hi, lo in CLIPS if not (m.endswith("truncate") and hi is None)], ids=str
)
def test_sampling_importance_weights_match_trl(rollouts, key):
    """grpo_fast.sampling_importance_weights against the ratio TRL's own _generate_and_score_completions computed."""
    mode, clip_max, clip_min = key
    out = rollouts[key]
    expected = out["importance_sampling_ratio"]
    weights = grpo_fast.sampling_importance_weights(
        out["old_per_token_logps"],
        out["sampling_per_token_logps"],
        out["completion_mask"],
        mode=mode,
        clip_max=clip_max,
        clip_min=clip_min,
    )
    assert weights.shape == expected.shape == ((6, 8) if mode.startswith("token") else (6, 1))
    assert not torch.isnan(weights).any()
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0.0)
    # not vacuous: values were clipped or masked on the active side(s)
    if mode.endswith("truncate"):
        assert (expected == clip_max).any() and (clip_min is None or (expected == clip_min).any())
    else:
        assert (expected == 0).any()


def test_sampling_importance_weights_defaults_are_trl_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    params = inspect.signature(grpo_fast.sampling_importance_weights).parameters
    assert params["mode"].default == fields["vllm_importance_sampling_mode"]
    assert params["clip_max"].default == fields["vllm_importance_sampling_clip_max"]
    assert params["clip_min"].default == fields["vllm_importance_sampling_clip_min"]


@pytest.mark.parametrize("backend", SIDES)
def test_vespo_with_sampler_weights_that_are_not_1_at_padding(trainer, batch, rollouts, backend):
    # TRL's VESPO sums log(importance_sampling_ratio) over every position, padding included, where its ratio is
    # exp(0) = 1 clamped into [clip_min, clip_max]: grpo_fast does the same
    ratio = rollouts["token_truncate", 3.0, 1.2]["importance_sampling_ratio"]  # 1.2 at padding (checked below)
    case = Case("vespo-clip_min-above-1", dict(loss_type="vespo"), is_mode="token_truncate")
    inputs = {**case.trl_inputs(batch), "importance_sampling_ratio": ratio}
    assert_matches_trl(
        run_trl(trainer, case, inputs),
        run_grpo_fast(trainer.model, inputs, backend, **case.grpo_fast_kwargs(inputs)),
        case.id,
    )


# ----------------------------------------------------------------------------------------------- defaults, errors
# grpo_fast.loss keywords that are not GRPOConfig options: per-batch tensors, the logit transform a model's config
# carries (TRL reads softcap / logit scale from it), the head's LoRA adapter (TRL reads it from the PEFT model), the
# precomputed top-entropy threshold, the backend and layer 1's path, backward and trained-head chunk, the
# distillation teacher and its coefficient and beta (DistillationConfig's names, not GRPOConfig's)
GRPO_FAST_ONLY_KEYWORDS = {
    "bias",
    "old_logprobs",
    "ref_logprobs",
    "sampling_logprobs",
    "importance_weights",
    "softcap",
    "logit_scale",
    "num_items_in_batch",
    "entropy_threshold",
    "backend",
    "entropy",
    "options",
    "head_path",
    "backward_mode",
    "trained_head_chunk",
    "vocab_parallel",
    "lora",
    "check_values",
    "teacher",
    "distillation_coef",
    "distillation_beta",
    "sampling_correction",
}


@pytest.mark.parametrize("fn", [grpo_fast.loss, grpo_fast.token_loss], ids=lambda f: f.__name__)
def test_keyword_defaults_are_grpo_config_defaults(fn):
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    keywords = {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    # and the loss options, taken as **option_keywords (typed by LossOptionKeywords: tests/test_options.py) with
    # LossOptions' defaults
    keywords |= {f.name: f.default for f in dataclasses.fields(grpo_fast.LossOptions)}
    for name, default in keywords.items():
        if name in GRPO_FAST_ONLY_KEYWORDS:
            assert name not in fields, f"{name} is a GRPOConfig field now: compare its default"
            continue
        assert name in fields, f"grpo_fast.{fn.__name__}'s {name} is not a GRPOConfig field (names must be TRL's)"
        assert default == fields[name], f"{name}: grpo_fast {default!r}, GRPOConfig {fields[name]!r}"
    # and every loss option the harness sets on the trainer is a grpo_fast keyword (bar TRL's vLLM options; token_loss
    # takes log-probs, so the temperature is already in them)
    layer_1 = {"temperature"} if fn is grpo_fast.token_loss else set()
    assert set(loss_option_defaults()) - set(TRL_ONLY_OPTIONS) - layer_1 <= set(keywords)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "sequence_as_[B]"])
def test_vespo_rejects_sequence_level_importance_weights(batch, rollouts, backend, mode):
    """TRL's __init__ refuses VESPO with a sequence-level vLLM importance sampling mode; grpo_fast refuses [B, 1]
    and [B] weights."""
    weights = rollouts[mode.replace("_as_[B]", "_mask"), 3.0, None]["importance_sampling_ratio"]
    if mode.endswith("[B]"):
        weights = weights.squeeze(1)
    hidden = torch.randn(6, 8, 16)
    weight = torch.randn(ASCII_VOCAB_SIZE, 16)
    inputs = batch["inputs"]
    with pytest.raises(ValueError, match="vespo"):
        grpo_fast.loss(
            hidden,
            weight,
            inputs["completion_ids"],
            batch["advantages"],
            inputs["completion_mask"],
            old_logprobs=batch["old"],
            importance_weights=weights,
            loss_type="vespo",
            backend=backend,
        )


# ----------------------------------------------------------------------------------------------- the harness itself
def test_temperature_repatch_is_faithful(trainer, batch):
    """set_loss_options(temperature=...) re-patches TRL's head; a trainer built at that temperature gives the same."""
    case = Case("temperature", dict(loss_type="dapo", temperature=0.7))
    inputs = case.trl_inputs(batch)
    repatched = run_trl(trainer, case, inputs)
    native = make_trainer(temperature=0.7)
    native.model.load_state_dict(trainer.model.state_dict())
    assert native.temperature == 0.7 and native.loss_type == "dapo"
    built = run_trl(native, Case("temperature-native"), inputs, reset=False)
    assert repatched[2] == built[2]
    torch.testing.assert_close(repatched[0], built[0], rtol=0, atol=0)
    for name, grad in built[1].items():
        torch.testing.assert_close(repatched[1][name], grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- Gemma 2's softcap
GEMMA2_CASES = [
    Case("gemma2-dapo-beta-is", dict(loss_type="dapo", beta=0.04), is_mode="token_truncate"),
    Case(
        "gemma2-grpo-sequence-entropy",
        dict(
            loss_type="grpo",
            importance_sampling_level="sequence",
            temperature=0.8,
            top_entropy_quantile=0.5,
            entropy_coef=0.01,
        ),
    ),
]


@pytest.fixture(scope="module")
def gemma2():
    """TRL's trainer around a tiny Gemma 2 (tied embeddings, final_logit_softcapping=5: the tanh bends the logits)."""
    trainer = make_trainer(tiny_gemma2(vocab_size=ASCII_VOCAB_SIZE, final_logit_softcapping=5.0))
    return trainer, make_batch(make_rollouts(trainer, clips=CLIPS[:1]))


@pytest.mark.parametrize("backend", SIDES)
@pytest.mark.parametrize("case", GEMMA2_CASES, ids=lambda c: c.id)
def test_softcapped_model_matches_trl(gemma2, case, backend):
    """TRL's head reads final_logit_softcapping from the config; grpo_fast takes it as softcap."""
    trainer, batch = gemma2
    inputs = case.trl_inputs(batch)
    if case.id not in _TRL_RESULTS:
        _TRL_RESULTS[case.id] = run_trl(trainer, case, inputs)
    fast = run_grpo_fast(
        trainer.model,
        inputs,
        backend,
        softcap=trainer.model.config.final_logit_softcapping,
        **case.grpo_fast_kwargs(inputs),
    )
    assert_matches_trl(_TRL_RESULTS[case.id], fast, f"[{case.id}, {backend}]")
