"""The sampler's support: log-probs renormalised over the set a truncating sampler (vLLM's top-k / top-p / min-p)
draws from, beside the full-vocabulary ones, without a [tokens, vocab] buffer (``sampler_logprobs``)."""
