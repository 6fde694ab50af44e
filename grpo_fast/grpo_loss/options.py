"""The loss's options and loss-type records: TRL 1.16.0 ``GRPOConfig``'s names and defaults, checked once.

``LossOptions`` is what every layer-2 implementation takes (the spec, the token kernel's launcher, its torch twin).
``grpo_fast.loss`` and ``grpo_fast.token_loss`` take the same names as keywords, typed by ``LossOptionKeywords``
(PEP 692), and turn them into a ``LossOptions`` with ``resolve``: an unknown name is a ``TypeError`` that lists them.
Each enumeration is a ``Literal`` (``LossTypeName``, ``ImportanceSamplingLevel``, ...); its runtime tuple
(``LOSS_TYPES``, ...) is derived from it.

Each loss type is one ``LossType`` record (``LOSS_TYPE_RECORDS``): its family of per-token term (a ``PolicyTerm``:
the formula's name and the facts its readers need besides the formula), its normaliser and its metrics. The readers
raise on a value they do not know, so a new loss type is its record, plus its term's formula in the spec, the token
kernel and the torch twin when it brings a new family.

The per-batch inputs (old / reference / sampler log-probs, importance weights, ``num_items_in_batch``,
``entropy_threshold``) are arguments of the functions, not options.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict, get_args

from grpo_fast.head.keywords import unexpected_keywords
from grpo_fast.head.transform import check_number
from grpo_fast.kernels.loss_statistics import STATISTICS

if TYPE_CHECKING:
    import torch

# The enumerations, each listed once: the Literal is what a type checker sees, the tuple what the checks read
LossTypeName = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
# TRL's vllm_importance_sampling_mode (grpo_fast.sampling_importance_weights)
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# what a per-token term's derivative is taken with respect to (PolicyTerm.gradient_wrt)
GradientWrt = Literal["ratio", "logprob"]
# a loss type's divisor (LossType.normaliser; LossOptions.denominator says each)
Normaliser = Literal["sequences", "tokens", "max_completion_length", "num_items_in_batch"]
# how a metric reduces its per-sequence values (Metric.reduce)
MetricReduction = Literal["mean", "min_over_sequences", "max_over_sequences"]

LOSS_TYPES: tuple[str, ...] = get_args(LossTypeName)
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)
IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = get_args(ImportanceSamplingMode)
GRADIENT_WRT: tuple[str, ...] = get_args(GradientWrt)
NORMALISERS: tuple[str, ...] = get_args(Normaliser)
METRIC_REDUCTIONS: tuple[str, ...] = get_args(MetricReduction)


@dataclass(frozen=True)
class Metric:
    """One metric a loss type logs, under TRL's name, reduced from one value per sequence of a statistic.

    Attributes:
        name: the metric's name (TRL's).
        statistic: the per-sequence statistic it reads, one of ``grpo_fast.kernels.loss_statistics.STATISTICS``.
        reduce: one of ``METRIC_REDUCTIONS``: "mean" (TRL's global masked mean: over tokens, or over sequences for a
            value with one per sequence), "min_over_sequences" / "max_over_sequences" (TRL's nanmin / nanmax of each
            sequence's mean). The metrics' readers raise on another.

    Raises:
        ValueError: ``statistic`` is not one of the statistics.
    """

    name: str
    statistic: str
    reduce: MetricReduction = "mean"

    def __post_init__(self):
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"metric {self.name!r}: statistic must be one of {tuple(STATISTICS)} "
                f"(grpo_fast.kernels.loss_statistics), got {self.statistic!r}"
            )


@dataclass(frozen=True)
class PolicyTerm:
    """A family of per-token term: the name of its formula and the facts about it that its readers need.

    Attributes:
        formula: the name the spec, the token kernel and the torch twin dispatch on: "clipped" (PPO's
            -min(r A, clamp(r, 1 - eps, 1 + eps_high) A)), "cispo", "sapo" or "vespo".
        options: the ``LossOptions`` attributes the formula reads beyond those every family reads (``clip_high``
            is epsilon_high as TRL resolves it); the clip indicators use ``delta`` only for a family that reads it.
        gradient_wrt: what the term's derivative is taken with respect to: "ratio" (dpg/dr, chained through r, the
            sequence ratio at sequence level) or "logprob" (a term -stopgrad(c) A logp: dpg/dlogp directly).
        gamma_weighted: the term is weighted by VESPO's gamma weight phi of the sequence's log W: its readers
            compute log W and phi, and return phi as the "phi" statistic.
        importance_weights_in_term: the importance weights enter the term, in phi's log W (per-token [B, T] weights
            only, summed over padding too, as TRL's), instead of multiplying it.

    Raises:
        ValueError: ``gradient_wrt`` is not one of ``GRADIENT_WRT``; ``gamma_weighted`` or
            ``importance_weights_in_term`` is not a bool; importance weights in a term without phi (nothing would
            read them).
    """

    formula: str
    options: tuple[str, ...] = ()
    gradient_wrt: GradientWrt = "ratio"
    gamma_weighted: bool = False
    importance_weights_in_term: bool = False

    def __post_init__(self):
        if self.gradient_wrt not in GRADIENT_WRT:
            raise ValueError(
                f"policy term {self.formula!r}: gradient_wrt must be one of {GRADIENT_WRT}, got {self.gradient_wrt!r}"
            )
        for name in ("gamma_weighted", "importance_weights_in_term"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"policy term {self.formula!r}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.importance_weights_in_term and not self.gamma_weighted:
            raise ValueError(
                f"policy term {self.formula!r} puts the importance weights in its term, but the term has no "
                "gamma weight phi whose log W would read them (gamma_weighted=False)"
            )


# TRL 1.16's families of per-token term, by formula
POLICY_TERMS = {
    term.formula: term
    for term in (
        PolicyTerm("clipped", options=("epsilon", "clip_high", "delta")),
        PolicyTerm("cispo", options=("clip_high",), gradient_wrt="logprob"),
        PolicyTerm("sapo", options=("sapo_temperature_pos", "sapo_temperature_neg")),
        PolicyTerm(
            "vespo",
            options=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
            gradient_wrt="logprob",
            gamma_weighted=True,
            importance_weights_in_term=True,
        ),
    )
}


@dataclass(frozen=True)
class LossType:
    """Everything about a loss type outside its formula; the spec, the token kernel's launcher, its torch twin and
    the metrics builder read it, and each raises on a value it does not know.

    Attributes:
        name: the loss type's name (``LossOptions.loss_type``).
        policy_term: its family of per-token term (a ``PolicyTerm``).
        normaliser: the loss's divisor (``LossOptions.denominator``), one of ``NORMALISERS``: "sequences" (B),
            "tokens" (the mask's sum), "max_completion_length" (B x max_completion_length), "num_items_in_batch"
            (default: the mask's sum).
        row_mean: each sequence's token sum is first divided by its own token count.
        metrics: the loss type's own metrics, beyond the ones every type logs (kl, entropy, policy_loss,
            ratio_mean).

    Raises:
        TypeError: ``policy_term`` is not a PolicyTerm.
    """

    name: str
    policy_term: PolicyTerm
    normaliser: Normaliser
    row_mean: bool = False
    metrics: tuple[Metric, ...] = ()

    def __post_init__(self):
        if not isinstance(self.policy_term, PolicyTerm):
            raise TypeError(f"loss type {self.name!r}: policy_term must be a PolicyTerm, got {self.policy_term!r}")


# TRL 1.16 logs these for its clipped loss types: the clip fractions (masked means), and the min / max over sequences
# of each sequence's low / high clip fraction
CLIP_METRICS = (
    Metric("clip_ratio/low_mean", "low"),
    Metric("clip_ratio/high_mean", "high"),
    Metric("clip_ratio/region_mean", "region"),
    Metric("clip_ratio/low_min", "low", "min_over_sequences"),
    Metric("clip_ratio/high_max", "high", "max_over_sequences"),
)

# TRL 1.16's loss types (GRPOTrainer._compute_loss), one record each, in LossTypeName's order
_CLIPPED, _CISPO, _SAPO, _VESPO = POLICY_TERMS.values()
LOSS_TYPE_RECORDS = {
    record.name: record
    for record in (
        LossType("grpo", _CLIPPED, "sequences", row_mean=True, metrics=CLIP_METRICS),
        LossType("bnpo", _CLIPPED, "tokens", metrics=CLIP_METRICS),
        LossType("dr_grpo", _CLIPPED, "max_completion_length", metrics=CLIP_METRICS),
        LossType("dapo", _CLIPPED, "num_items_in_batch", metrics=CLIP_METRICS),
        LossType("cispo", _CISPO, "num_items_in_batch", metrics=(Metric("cispo_clip_ratio", "cispo"),)),
        LossType("sapo", _SAPO, "sequences", row_mean=True),
        LossType("luspo", _CLIPPED, "sequences", metrics=CLIP_METRICS),
        LossType("vespo", _VESPO, "num_items_in_batch", metrics=(Metric("vespo/phi_seq_mean", "phi"),)),
    )
}
# normalised by num_items_in_batch (the tokens of the whole gradient-accumulation window): a training loop sums
# those losses over its micro-batches, and averages the others
NUM_ITEMS_LOSS_TYPES = tuple(
    name for name, record in LOSS_TYPE_RECORDS.items() if record.normaliser == "num_items_in_batch"
)


def _at_least_one(count):
    """max(count, 1): a float for a number, a tensor (never read on the host) for a tensor."""
    return count.clamp(min=1.0) if hasattr(count, "clamp") else max(float(count), 1.0)


@dataclass(frozen=True)
class LossOptions:
    """TRL 1.16.0 ``GRPOConfig``'s loss options, with its names and defaults, checked once.

    docs/options.md says what each computes; ``loss`` and ``token_loss`` take the same names as
    keywords.

    Attributes:
        loss_type: the loss type, one of ``LOSS_TYPES`` (``LossTypeName``).
        beta: the KL coefficient (k3 estimator); non-zero needs ``ref_logprobs``.
        epsilon: the lower clip offset: the ratio is clipped to [1 - epsilon, 1 + epsilon_high] (>= 0).
        epsilon_high: the upper clip offset (>= 0; cispo's cap on the ratio); None: ``epsilon``.
        delta: two-sided clipping: the ratio is also capped at delta; None: no cap.
        importance_sampling_level: "token" (per-token ratios) or "sequence" (GSPO): ``ImportanceSamplingLevel``.
        max_completion_length: dr_grpo's normaliser (a positive int).
        sapo_temperature_pos: sapo's gate temperature for positive advantages.
        sapo_temperature_neg: sapo's gate temperature for the others.
        vespo_k_pos: vespo's gamma weight k for non-negative advantages.
        vespo_lambda_pos: vespo's gamma weight lambda for non-negative advantages.
        vespo_k_neg: vespo's k for negative advantages.
        vespo_lambda_neg: vespo's lambda for negative advantages.
        use_bias_correction_kl: multiply the per-token KL by the importance ratio.
        off_policy_mask_threshold: drop sequences with a negative advantage whose mean KL(sampler, policy)
            exceeds it; None: no mask.
        top_entropy_quantile: in [0, 1]: only tokens at or above this quantile of the entropies carry the policy
            loss; 1: every token.
        entropy_coef: the entropy bonus: the loss minus entropy_coef x the mean entropy.

    Raises:
        ValueError: an unknown loss_type or importance_sampling_level, a number that is not finite, a negative
            epsilon, a max_completion_length that is not a positive int, a non-bool use_bias_correction_kl, or a
            top_entropy_quantile outside [0, 1].
    """

    loss_type: LossTypeName = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_completion_length: int = 512
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPE_RECORDS:
            raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPE_RECORDS)}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                f"{self.importance_sampling_level!r}"
            )
        for name in (
            "beta",
            "epsilon",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
            "entropy_coef",
        ):
            check_number(name, getattr(self, name))
        for name in ("epsilon_high", "delta", "off_policy_mask_threshold"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name))
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"epsilon and epsilon_high must be >= 0, got {self.epsilon}, {self.epsilon_high}")
        mcl = self.max_completion_length
        if isinstance(mcl, bool) or not isinstance(mcl, numbers.Integral) or mcl <= 0:
            raise ValueError(f"max_completion_length must be a positive int (the dr_grpo normaliser), got {mcl!r}")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        check_number("top_entropy_quantile", self.top_entropy_quantile, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")

    # ------------------------------------------------------------------------------------------ derived facts
    @property
    def clip_high(self) -> float:
        """The upper clip offset: ``epsilon_high``, or ``epsilon`` when it is None (TRL's rule)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def sequence_level(self) -> bool:
        """The importance ratio is one per sequence (``importance_sampling_level="sequence"``)."""
        return self.importance_sampling_level == "sequence"

    @property
    def loss_type_record(self) -> LossType:
        """The loss type's record (``LOSS_TYPE_RECORDS``)."""
        return LOSS_TYPE_RECORDS[self.loss_type]

    @property
    def token_local(self) -> bool:
        """The loss's dL/dlogp of a token reads no other token's log-prob or entropy (only its own values and the
        batch's normalisers, which the mask gives) and the entropy takes no gradient: not GSPO's sequence ratio,
        VESPO's sequence weight (``PolicyTerm.gamma_weighted``), the top-entropy mask, the off-policy mask (a
        sequence's mean KL) or the entropy bonus. A trained head can then form its gradients while each token's
        logits are in hand (the three-sweep head)."""
        return not (
            self.sequence_level
            or self.loss_type_record.policy_term.gamma_weighted
            or self.entropy_mask
            or self.off_policy_mask_threshold is not None
            or self.entropy_coef != 0.0
        )

    @property
    def entropy_mask(self) -> bool:
        """Only the top ``top_entropy_quantile`` of tokens by entropy carry the policy loss."""
        return self.top_entropy_quantile < 1.0

    def denominator(self, batch_size, mask_total, num_items_in_batch=None) -> float:
        """The loss's divisor: loss = sum_b (sum_t m l [/ the row's token count with ``row_mean``]) / denominator.

        TRL's reductions at one process without gradient accumulation, by the loss type's normaliser: "sequences":
        B (a mean over sequences); "tokens": the mask's sum; "max_completion_length": B * max_completion_length;
        "num_items_in_batch": ``num_items_in_batch`` (default: the mask's sum). Sums are clamped at 1 (an all-masked
        batch gives 0).

        Args:
            batch_size: B, the number of sequences.
            mask_total: the completion mask's sum: a number, or a scalar tensor.
            num_items_in_batch: the gradient-accumulation window's token count (a number or a scalar tensor);
                None: ``mask_total``.

        Returns:
            The divisor: a float, or a scalar tensor on its device (never read on the host) for a tensor count.

        Raises:
            ValueError: the loss type's record has a normaliser this method does not know.
        """
        normaliser = self.loss_type_record.normaliser
        if normaliser == "sequences":
            return float(batch_size)
        if normaliser == "tokens":
            return _at_least_one(mask_total)
        if normaliser == "max_completion_length":
            return float(batch_size * self.max_completion_length)
        if normaliser == "num_items_in_batch":
            return _at_least_one(mask_total if num_items_in_batch is None else num_items_in_batch)
        raise ValueError(f"loss type {self.loss_type!r} has an unknown normaliser {normaliser!r}")

    def aggregate(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, num_items_in_batch: float | torch.Tensor | None = None
    ) -> torch.Tensor:
        """The loss type's reduction of a per-token loss to the loss (TRL's, at one process without gradient
        accumulation): each row's masked sum (divided by its token count with the record's ``row_mean``), summed,
        over ``denominator``: the sum of the masked values times ``aggregate_weights``.

        Masked tokens are selected out, not multiplied by 0 as TRL does: a NaN there (in a sequence without tokens,
        whose advantage may be anything) changes nothing, as in the token kernel.

        Args:
            per_token_loss: [B, T] tensor.
            mask: the completion mask [B, T] (bool or 0 / 1).
            num_items_in_batch: the "num_items_in_batch" normaliser's count (a number or a device tensor), or None.

        Returns:
            The loss, a scalar tensor.

        Raises:
            ValueError: the record's normaliser is unknown (``denominator``).
        """
        weights = self.aggregate_weights(mask, num_items_in_batch).to(per_token_loss.dtype)
        return (per_token_loss.where(mask.bool(), 0.0) * weights).sum()

    def aggregate_weights(
        self, mask: torch.Tensor, num_items_in_batch: float | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each token's weight in ``aggregate`` (its derivative: the reduction is linear), [B, T] fp32: the mask,
        over the row's token count with the record's ``row_mean``, over ``denominator``; 0 off the mask.

        Args:
            mask: the completion mask [B, T] (bool or 0 / 1).
            num_items_in_batch: as ``aggregate``'s.

        Returns:
            [B, T] fp32 weights on the mask's device.
        """
        mask = mask.float()
        weights = mask / self.denominator(mask.size(0), mask.sum(), num_items_in_batch)
        if self.loss_type_record.row_mean:
            weights = weights / mask.sum(-1, keepdim=True).clamp(min=1.0)
        return weights

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def resolve(
        cls, options: LossOptions | None = None, keywords: dict | None = None, caller: str = "loss"
    ) -> LossOptions:
        """``options`` with TRL-style ``keywords`` applied on top.

        Args:
            options: the base options; None: TRL's defaults.
            keywords: option names and values to replace; None: none.
            caller: the function named in the unknown-name error.

        Returns:
            The options, a new LossOptions when keywords change them.

        Raises:
            TypeError: ``options`` not a LossOptions, or a keyword that is not an option (the error lists them).
            ValueError: a keyword's value is not a valid option.
        """
        if options is not None and not isinstance(options, LossOptions):
            raise TypeError(f"options must be a grpo_fast.LossOptions, got {type(options).__name__}")
        keywords = keywords or {}
        unknown = set(keywords) - set(FIELD_NAMES)
        if unknown:
            raise unexpected_keywords(caller, unknown, (), ("the loss options", FIELD_NAMES))
        base = options if options is not None else cls()
        return dataclasses.replace(base, **keywords) if keywords else base

    @classmethod
    def from_trl(cls, config) -> LossOptions:
        """The options of a TRL ``GRPOConfig``.

        Args:
            config: a ``GRPOConfig``, or any object with its attribute names (missing ones keep their defaults).

        Returns:
            The options.

        Raises:
            ValueError: an attribute's value is not a valid option.
        """
        return cls(**{name: getattr(config, name) for name in FIELD_NAMES if hasattr(config, name)})


class LossOptionKeywords(TypedDict, total=False):
    """The loss options as keywords of ``grpo_fast.loss`` and ``token_loss`` (``**option_keywords:
    Unpack[LossOptionKeywords]``, PEP 692): an IDE and a type checker see each name and type. Each is the
    ``grpo_fast.LossOptions`` field of that name (its meaning; its default, TRL's); a keyword left out
    keeps the default, or the value in the call's ``options``."""

    loss_type: LossTypeName
    beta: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    importance_sampling_level: ImportanceSamplingLevel
    max_completion_length: int
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    use_bias_correction_kl: bool
    off_policy_mask_threshold: float | None
    top_entropy_quantile: float
    entropy_coef: float


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions))
