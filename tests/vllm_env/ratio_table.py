"""The importance ratio TRL 1.16 forms against vLLM's processed log-probs, and the one over the sampler's support, on
the tiny random Qwen2 of the vLLM tests, as a markdown table (docs/sampler-support.md includes it).

Run in vLLM's environment (.ci/run builds it):

    $GRPO_FAST_VLLM_PYTHON tests/vllm_env/ratio_table.py --out bench/results/sampler-support-ratio.md
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile

for name, value in (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
):
    os.environ.setdefault(name, value)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import vllm_harness as harness  # noqa: E402

import grpo_fast  # noqa: E402

SETTINGS = [
    harness.Sampling(1.0, top_k=20),
    harness.Sampling(1.0, top_p=0.9),
    harness.Sampling(1.0, top_p=0.7),
    harness.Sampling(1.0, min_p=0.1),
    harness.Sampling(0.7, top_p=0.9),
]


def _name(s):
    rules = [("top_k", s.top_k, s.top_k > 0), ("top_p", s.top_p, s.top_p < 1), ("min_p", s.min_p, s.min_p > 0)]
    return ", ".join([f"T={s.temperature:g}"] + [f"{k}={v:g}" for k, v, on in rules if on])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the markdown file (default: stdout)")
    parser.add_argument("--sequences", type=int, default=16, help="completions per setting")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per completion")
    args = parser.parse_args(argv)
    harness.MAX_TOKENS = args.tokens
    with tempfile.TemporaryDirectory() as folder:
        model = harness.write_model(folder)
        llm = harness.engine(folder, "processed_logprobs")
        lines = [
            "| sampling | tokens | TRL 1.16's ratio: mean | outside [0.9, 1.1] | over the support: mean "
            "| outside [0.9, 1.1] | max abs log-ratio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for s in SETTINGS:
            (r,) = harness.add_hidden(model, harness.generate(llm, [s], sequences=args.sequences, seed=1))
            processed = r.logprobs.gather(-1, r.tokens[..., None]).squeeze(-1).float()
            sampling = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)
            out = grpo_fast.sampler_logprobs(
                r.hidden, model.lm_head.weight.detach(), r.tokens, backend="torch", **sampling
            )
            trl, ours = (out.logprobs - processed).exp(), (out.support_logprobs - processed).exp()
            outside = [((x < 0.9) | (x > 1.1)).float().mean().item() for x in (trl, ours)]
            worst = (out.support_logprobs - processed).abs().max().item()
            lines.append(
                f"| {_name(s)} | {r.tokens.numel()} | {trl.mean().item():.4f} | {outside[0]:.0%} "
                f"| {ours.mean().item():.6f} | {outside[1]:.0%} | {worst:.1e} |"
            )
    import vllm

    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    commit = commit.stdout.strip()
    lines += [
        "",
        f"*vLLM {vllm.__version__} on {platform.machine()} CPUs, fp32; grpo_fast {grpo_fast.__version__} at "
        f"{commit or 'a checkout'}, {datetime.date.today()}; {args.sequences} completions of {args.tokens} tokens a "
        "setting (vocabulary 512: a random model's flat distributions keep little mass in a top-k of 20). Regenerate: "
        "`$GRPO_FAST_VLLM_PYTHON tests/vllm_env/ratio_table.py --out bench/results/sampler-support-ratio.md`.*",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
