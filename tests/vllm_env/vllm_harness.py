"""Builders for the vLLM tests: a tiny random Qwen2 written with transformers (config in code, no hub), vLLM's engine
on it, rollouts with full-vocabulary log-probs, the same positions' hidden states from transformers, and vLLM 0.32's
kept-set rules written out plainly (fp64, one row at a time) with the margin of each row's closest decision."""

import dataclasses
import math

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 512
HIDDEN = 128  # two heads of 64: vLLM's CPU attention takes head sizes 32, 64 and 80 up
# the lm_head's init: logits of a few units (at most about 10 over the temperature 0.7), so that fp32's rounding of
# the logits (vLLM's GEMM against grpo_fast's, a few ulps of the largest) stays well under the 1e-5 compared, and
# still a peaked distribution that top-k, top-p and min-p all cut
HEAD_STD = 0.15
MAX_TOKENS = 6
TOL = 1e-5
# a row whose closest kept-set decision lies within this of its threshold (in logits for min-p and top-k, in
# probability mass for top-p) may fall either way between vLLM's fp32 logits and transformers' (a few 1e-6 apart)
TIE = 1e-4


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def id(self):
        return f"T{self.temperature}-k{self.top_k}-p{self.top_p}-m{self.min_p}"

    def params(self, seed):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logprobs=-1,  # every vocabulary entry: -inf outside the kept set in processed_logprobs mode
            seed=seed,
        )


def write_model(path, seed=0):
    """A tiny random Qwen2 (fp32, untied head) saved with transformers at ``path``; returns the model."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, HEAD_STD)
    model.save_pretrained(path)
    return model.eval()


def engine(path, logprobs_mode):
    """vLLM's offline engine on the model at ``path``, in fp32, every entry's log-prob available (max_logprobs=-1),
    token ids in and out (no tokenizer)."""
    from vllm import LLM

    return LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=128,
        max_logprobs=-1,
        logprobs_mode=logprobs_mode,
        enforce_eager=True,
        seed=0,
    )


@dataclasses.dataclass
class Rollout:
    """One request's completions: prompts, sampled ids [B, T], vLLM's log-prob dicts per token, dense [B, T, V]."""

    sampling: Sampling
    prompts: list
    tokens: torch.Tensor
    dicts: list
    logprobs: torch.Tensor
    hidden: torch.Tensor = None


def prompts_for(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def generate(llm, samplings, sequences=2, seed=0):
    """One ``llm.generate`` call (one batch: vLLM picks its top-k / top-p path for the batch) of ``sequences``
    prompts per sampling; a Rollout each."""
    prompts = prompts_for(len(samplings) * sequences, seed)
    params = [s.params(seed + i) for i, s in enumerate(samplings) for _ in range(sequences)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rollouts = []
    for i, sampling in enumerate(samplings):
        chunk = outputs[i * sequences : (i + 1) * sequences]
        tokens = torch.tensor([list(o.outputs[0].token_ids) for o in chunk])
        dicts = [o.outputs[0].logprobs for o in chunk]
        dense = torch.full((*tokens.shape, VOCAB), -math.inf, dtype=torch.float64)
        for b, sequence in enumerate(dicts):
            for t, entries in enumerate(sequence):
                assert len(entries) == VOCAB, f"logprobs=-1 returns every entry, got {len(entries)}"
                for v, logprob in entries.items():
                    dense[b, t, v] = logprob.logprob
        rollouts.append(Rollout(sampling, prompts[i * sequences : (i + 1) * sequences], tokens, dicts, dense))
    return rollouts


@torch.no_grad()
def add_hidden(model, rollouts):
    """Each rollout's hidden states from transformers: hidden[b, t] (the last layer, after the final norm) predicts
    tokens[b, t]."""
    for r in rollouts:
        rows = []
        for prompt, completion in zip(r.prompts, r.tokens.tolist()):
            ids = torch.tensor([prompt + completion[:-1]])
            rows.append(model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 :])
        r.hidden = torch.stack(rows)
    return rollouts


@torch.no_grad()
def logits_over_temperature(model, hidden, temperature):
    """z = hidden @ W^T / T in fp32, as vLLM forms it (fp32 logits divided in place by the fp32 temperature)."""
    logits = hidden @ model.lm_head.weight.T
    return logits / torch.tensor(temperature, dtype=torch.float32)


def rule_kept(z, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM 0.32's kept set for one row z [V] (the logits over the temperature), written plainly in fp64: min-p, then
    top-k over the survivors (ties with the k-th kept), then top-p over the survivors' renormalised distribution (an
    entry is kept when the survivors strictly above it hold less than top_p). Returns (keep [V] bool, margin): the
    distance of the row's closest decision from its threshold (logits for min-p and top-k, mass for top-p)."""
    z = z.double().numpy()
    keep = np.ones(z.shape, dtype=bool)
    margin = math.inf
    if min_p > 0:
        gap = z - z.max() - math.log(min_p)  # p_v >= min_p * p_max  <=>  z_v - z_max >= log(min_p)
        keep &= gap >= 0
        margin = min(margin, float(np.abs(gap).min()))
    if 0 < top_k < z.size:
        survivors = np.sort(z[keep])[::-1]
        if survivors.size > top_k:
            keep &= z >= survivors[top_k - 1]
            margin = min(margin, float(survivors[top_k - 1] - survivors[top_k]))
    if top_p < 1:
        ids = np.flatnonzero(keep)
        values = z[ids]
        q = np.exp(values - values.max())
        q /= q.sum()
        order = np.argsort(-values, kind="stable")
        ascending = -values[order]
        before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        # the mass strictly above an entry: the cumulative mass before the first entry of its tie group
        above = before[np.searchsorted(ascending, ascending, side="left")]
        keep[ids[order]] = above < top_p
        margin = min(margin, float(np.abs(above - top_p).min()))
    return torch.from_numpy(keep), margin
