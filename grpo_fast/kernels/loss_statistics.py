"""The per-sequence statistics of layer 2, named once: the token kernel's slots, its torch twin's keys and what a
metric reads (``Metric.statistic``). The kernels own it: it imports nothing.
"""

# name: what a sequence's value is (a masked sum over its tokens unless ``returned_statistics`` says it is the
# sequence's own value); the order is the token kernel's slot order
STATISTICS = {
    "loss": "the sequence's share of the policy loss, already normalised",
    "count": "its completion tokens",
    "kl": "the per-token KL (a KL term only)",
    "entropy": "the token entropies (when the entropy is given)",
    "ratio": "the importance ratio (at sequence level the sequence's ratio)",
    "low": "the low clip indicator",
    "high": "the high clip indicator",
    "region": "the low or high clip indicator",
    "cispo": "CISPO's clip indicator",
    "phi": "VESPO's phi (vespo's term only)",
    "bonus_count": "the entropy bonus's tokens",
    "bonus_entropy": "the entropy bonus's tokens' entropies",
}
SLOTS = {name: slot for slot, name in enumerate(STATISTICS)}


def returned_statistics(
    *, sequence_level: bool, advantages_per_token: bool, has_kl: bool, has_entropy: bool, has_phi: bool
) -> dict[str, bool]:
    """The statistics a layer-2 implementation returns, each with whether it is one value per sequence.

    Args:
        sequence_level: the importance ratio is the sequence's (GSPO).
        advantages_per_token: advantages [B, T], not [B].
        has_kl: a KL term (beta != 0 and reference log-probs).
        has_entropy: the token entropies are given.
        has_phi: the loss type's term computes VESPO's phi.

    Returns:
        ``{statistic: per_sequence}``: per_sequence is True where the value is the sequence's own (the sequence
        ratio; the clip indicators of a sequence-level ratio with per-sequence advantages; phi with per-sequence
        advantages), which TRL averages over sequences rather than tokens.
    """
    sequence_clip = sequence_level and not advantages_per_token
    per_sequence = {
        "ratio": sequence_level,
        "low": sequence_clip,
        "high": sequence_clip,
        "region": sequence_clip,
        "cispo": sequence_clip,
        "phi": not advantages_per_token,
    }
    computed = {"kl": has_kl, "entropy": has_entropy, "phi": has_phi}
    return {name: per_sequence.get(name, False) for name in STATISTICS if computed.get(name, True)}
