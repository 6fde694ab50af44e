"""The estimate against a card: the allowance for what the tracker cannot see, the verdict, and the report's files
(the numbers as JSON, a Markdown table, a plot by category)."""

from __future__ import annotations

import dataclasses
import textwrap

import torch

GIB = 2**30

# What the tracker cannot see, added to each estimate before it is compared with the card (the .md says why)
ALLOWANCE = {
    "cuda_context_gib": 1.0,  # driver, kernel images, cuBLAS / cuDNN handles: 0.5-1 GiB outside torch's allocator
    "fragmentation_fraction": 0.15,  # reserved over allocated: lengths change every step, segments are reused
}

CATEGORIES = (
    "weights",
    "reference weights",
    "teacher weights",
    "gradients",
    "optimizer state",
    "optimizer step temporaries",
    "model activations",
    "loss head buffers",
)
# each category's row in the table: what it holds at the step's peak (a head whose peak falls in the model's
# backward holds the model's activations there, checkpoints and the layer being recomputed; one whose peak falls in
# the head holds its own buffers on top of the checkpoints)
ROWS = {
    "weights": "weights",
    "reference weights": "reference weights (the KL term's copy)",
    "teacher weights": "teacher weights",
    "gradients": "gradients",
    "optimizer state": "optimizer state",
    "optimizer step temporaries": "optimizer step temporaries",
    "model activations": "model activations held at the peak",
    "loss head buffers": "loss head's buffers held at the peak",
}


def gib(n_bytes: int) -> float:
    """Bytes in GiB (2**30 bytes)."""
    return n_bytes / GIB


def allowance_gib(peak_gib: float) -> float:
    """What the tracker cannot see (``ALLOWANCE``) for an estimated peak in GiB: the CUDA context plus the
    fragmentation fraction of the peak, GiB."""
    return ALLOWANCE["cuda_context_gib"] + ALLOWANCE["fragmentation_fraction"] * peak_gib


def verdict(peak_bytes: int, card_gib: float) -> dict:
    """Whether an estimated peak fits a card of ``card_gib`` GiB once the allowance is added: the peak, the
    allowance, their sum and the margin left (GiB, to 3 decimals), and ``fits``."""
    peak = gib(peak_bytes)
    allowance = allowance_gib(peak)
    return {
        "peak_gib": round(peak, 3),
        "allowance_gib": round(allowance, 3),
        "with_allowance_gib": round(peak + allowance, 3),
        "margin_gib": round(card_gib - peak - allowance, 3),
        "fits": peak + allowance <= card_gib,
    }


def to_json(result: dict, command: str) -> dict:
    """The report as the .json file writes it: the command that regenerates it, the recipe, the versions, the card,
    the allowance, and each head's and the generation phase's numbers with their verdicts against the card.
    ``result``: ``grpo_fast.memory.estimate``'s."""
    recipe, gpu = result["recipe"], result["gpu"]
    card_gib = gpu.memory_gib

    def plain(value):
        if isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        return list(value) if isinstance(value, tuple) else value

    out = {
        "command": command,
        "recipe": {k: plain(getattr(recipe, k)) for k in (f.name for f in dataclasses.fields(recipe)) if k != "shape"}
        | {"shape": dataclasses.asdict(recipe.shape), "description": recipe.describe()},
        "versions": result["versions"],
        "card": {"name": gpu.name, "gib": round(card_gib, 3)}
        | {k: v for k, v in dataclasses.asdict(gpu).items() if k not in ("name", "memory_gib")},
        "allowance": ALLOWANCE,
        "heads": {},
        "generation": result["generation"] | verdict(result["generation"]["total_bytes"], card_gib),
    }
    for head, step in result["heads"].items():
        out["heads"][head] = step | verdict(step["peak_bytes"], card_gib)
    return out


def answer(report: dict) -> str:
    """The verdict in one line of Markdown: each head's step and the generation phase, with the allowance, against
    the card. ``report``: ``to_json``'s."""
    heads = list(report["heads"].values())
    g = report["generation"]
    everything = heads + [g]
    verdict_words = (
        "fits with every head"
        if all(x["fits"] for x in everything)
        else "does not fit with every head"
        if any(x["fits"] for x in everything)
        else "does not fit"
    )
    steps = "; ".join(f"{h['label']} {h['with_allowance_gib']:.2f} (margin {h['margin_gib']:+.2f})" for h in heads)
    return (
        f"**{report['card']['name']} ({report['card']['gib']:.2f} GiB): {verdict_words}.** Expected on the card "
        f"(estimate + allowance), GiB: the training step with {steps}; the generation phase "
        f"{g['with_allowance_gib']:.2f} (margin {g['margin_gib']:+.2f})."
    )


# the packages besides torch whose versions the report names, as it names them
_PACKAGE_NAMES = {"transformers": "transformers", "peft": "PEFT", "trl": "TRL"}


def markdown(report: dict, explain: bool = True) -> str:
    """The report as the .md file writes it: the table by category at each head's peak, then three lines (the
    verdict, the generation phase, where to read more); with ``explain``, also the command that regenerates it, the
    versions and what the estimate counts and leaves out. ``report``: ``to_json``'s."""
    r = report["recipe"]
    card = report["card"]
    heads = list(report["heads"].values())
    lines = [f"# Peak GPU memory of one GRPO step: {r['description']}", ""]
    if explain:
        versions = ", ".join(
            f"{_PACKAGE_NAMES.get(name, name)} {version}"
            for name, version in report["versions"].items()
            if name != "torch"
        )
        lines += [
            "Regenerate (CPU, no GPU, no hub; tens of seconds a head):",
            "",
            "```",
            report["command"],
            "```",
            "",
            (
                f"Estimated with torch {report['versions']['torch']}'s memory tracker over fake tensors "
                f"({versions}); GiB (2^30 bytes). The card: {card['name']}, {card['gib']:.2f} GiB "
                f"({card['gib'] * 1024:.0f} MiB)."
            ),
            "",
        ]
    lines += [
        "| GiB | " + " | ".join(h["label"] for h in heads) + " |",
        "|---|" + "---:|" * len(heads),
        "| the peak falls in | " + " | ".join(h["peak_in"] for h in heads) + " |",
    ]
    for category in CATEGORIES:
        if any(h["categories_bytes"].get(category, 0) for h in heads):
            cells = " | ".join(f"{gib(h['categories_bytes'].get(category, 0)):.2f}" for h in heads)
            lines.append(f"| {ROWS[category]} | {cells} |")
    rows = [
        ("**estimated peak**", lambda h: f"**{h['peak_gib']:.2f}**"),
        ("loss head's buffers at its own peak", lambda h: f"{gib(h['loss_head_peak_bytes']):.2f}"),
        ("+ allowance (not tracked)", lambda h: f"{h['allowance_gib']:.2f}"),
        ("= expected on the card", lambda h: f"{h['with_allowance_gib']:.2f}"),
        (
            f"fits {card['gib']:.2f} GiB?",
            lambda h: ("yes" if h["fits"] else "**no**") + f", margin {h['margin_gib']:+.2f}",
        ),
    ]
    if any("old_policy_pass" in h for h in heads):  # the sampler head's passes, each with its own peak

        def passes(key, h):
            part = h.get(key) or (h if key == "training_pass" and "old_policy_pass" in h else None)
            return f"{gib(part['peak_bytes']):.2f} ({part['peak_in']})" if part else ""

        rows += [
            ("old policy's pass (no grad): peak", lambda h: passes("old_policy_pass", h)),
            ("training step: peak", lambda h: passes("training_pass", h)),
        ]
    if all("measured" in h for h in heads):
        device = heads[0]["measured"]["device"]
        rows += [
            (f"measured on {device}: max allocated", lambda h: f"{gib(h['measured']['max_allocated_bytes']):.2f}"),
            ("measured: max reserved", lambda h: f"{gib(h['measured']['max_reserved_bytes']):.2f}"),
            ("measured: device used (context included)", lambda h: f"{gib(h['measured']['device_used_bytes']):.2f}"),
        ]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(h) for h in heads) + " |")
    g = report["generation"]
    parts = g["parts_bytes"]
    weights = parts["weights"] + parts["reference weights"] + parts.get("teacher weights", 0)
    lines += [
        "",
        answer(report),
        "",
        (
            f"Generation phase (HF generate, {g['sequences']} sequences x {g['tokens']} tokens): weights "
            f"{gib(weights):.2f} + optimizer state {gib(parts['optimizer state']):.2f} + key / value cache "
            f"{gib(parts['kv cache']):.2f} = **{g['peak_gib']:.2f} GiB**, with the allowance "
            f"{g['with_allowance_gib']:.2f}: {'fits' if g['fits'] else 'does not fit'} (margin "
            f"{g['margin_gib']:+.2f}); the step and the generation do not overlap."
        ),
        "",
    ]
    if not explain:
        lines.append(
            "--explain: what each row counts, the key / value cache's arithmetic and what the estimate leaves out; "
            "--out FILE: the numbers as FILE.json, this report in full as FILE.md, a plot as FILE.png."
        )
        return "\n".join(lines) + "\n"
    lines += [
        (
            f"The key / value cache: {r['shape']['num_layers']} layers x 2 x {r['shape']['num_kv_heads']} kv heads x "
            f"{_head_dim(r['shape'])} x {g['sequences']} x {g['tokens']} tokens x "
            f"{2 if r['dtype'] in ('bfloat16', 'float16') else 4} bytes; the run's peak is the larger of the step's "
            "and the generation's."
        ),
        "",
    ]
    text = HOW_TO_READ.format(
        heads=", ".join(h["description"] for h in heads),
        card=card["name"],
        arch=card["compute_capability"],
        prompts=r["prompts_per_step"],
        prompt_length=r["prompt_length"],
        ctx=ALLOWANCE["cuda_context_gib"],
        frag=round(100 * ALLOWANCE["fragmentation_fraction"]),
    )
    if any(h.get("sampler") for h in heads):
        from grpo_fast.memory import support_workspace as sampler

        text += SAMPLER_NOTE.format(
            rules=sampler.FORWARD_BUFFERS["top_k"],
            top_p=sampler.FORWARD_BUFFERS["top_p"],
            backward=sampler.BACKWARD_BUFFERS + sampler.HALF_COPY_BUFFERS,
            replayed_forward=sampler.REPLAYED_FORWARD,
            replayed_backward=sampler.REPLAYED_BACKWARD,
        )
    paragraphs = text.split("\n\n")
    lines += ["\n\n".join([paragraphs[0]] + [textwrap.fill(p, width=116) for p in paragraphs[1:]])]
    return "\n".join(lines) + "\n"


HOW_TO_READ = """## What is estimated, what is not

Estimated: every tensor the step allocates through torch (the tracker sees each op's outputs and frees), in the
steady state of a training loop such as examples/train_gsm8k.py's: the optimizer state of an earlier update, the
gradients of an earlier micro-batch, one micro-batch's forward and backward at full length (every prompt at the
recipe's longest, every completion at its maximum: the worst case), then gradient clipping and AdamW's foreach update.
Rows: what is held at the moment of each head's peak ("the peak falls in" says which), so a row compares heads at
different moments: weights (the policy's parameters and buffers; LoRA adapters in fp32), reference weights (the KL
term's frozen copy, full-parameter runs only), teacher weights (a distillation head's teacher model in the process),
gradients, optimizer state (AdamW's two moments and step counts), optimizer step temporaries (the foreach update's),
model activations held at the peak (everything else the step holds outside the loss head: the checkpoints, the
inputs, and where the peak falls in the model's backward the layer being recomputed and the backward's temporaries:
a head that frees its buffers before the model's backward peaks there, with more of these and none of its own) and
the loss head's buffers held at the peak (what the head holds above the memory at its entry, when the peak falls
inside it). "Loss head's buffers at its own peak": the same quantity at the head's own peak. The heads: {heads}. Every
head's log-probs go through grpo_fast's token loss on its Triton path, as training with grpo_fast does; grpo_fast's
custom ops run their fake implementations, which allocate the outputs, and the tracker adds each op's workspace
(grpo_fast's workspace_bytes, sized for the {card}'s sm_{arch}) while it runs. The model: no weight is made or
downloaded; transformers builds it from its config on the meta device, PEFT's get_peft_model applies LoRA there (it
cannot move fake tensors), then every parameter and buffer becomes a fake CPU tensor of its shape and dtype (tied
weights stay one tensor).

Not tracked, and the allowance added for it: the CUDA context (driver, kernel images, cuBLAS / cuDNN handles, the
Triton kernels' modules): {ctx} GiB, the high end of the 0.5-1 GiB torch 2.x takes on a card; the caching allocator's
fragmentation and rounding (reserved over allocated) and cuBLAS's workspaces (allocated through the caching allocator,
a few MiB to 32 MiB a stream): {frag} % of the estimated peak, since completion lengths change every step and segments
of one size are reused for others (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True narrows it). Not included at all:
NCCL buffers (one GPU, no process group), a separate rollout engine (the recipe samples with HF generate in the same
process: the generation phase above; a colocated vLLM would take its gpu_memory_utilization share on top), a
display's framebuffer on a desktop card (a few hundred MiB), and the prompt prefill's transients during generation
(each distinct prompt runs once: {prompts} x {prompt_length} tokens). The estimate is to be checked against
torch.cuda.max_memory_allocated / max_memory_reserved on a GPU: tools/gpu_checklist.sh does it (MEMORY=1).
"""


SAMPLER_NOTE = """
grpo_fast.sampler_logprobs (the sampler head): its custom ops allocate their outputs over fake tensors, and the tracker
adds their real implementations' buffers by grpo_fast.memory.sampler's model (support_twin's chunked torch code, which
the Triton backend runs for the sampling parameters): with the parameters, one chunk of r = min(N, 2^27 / 4V) token
rows' whole fp32 logits [r, V] and the rules' temporaries of that shape ({rules:g} such buffers for top-k and min-p,
{top_p:g} for top-p's worst case: rows whose 1024 largest logits do not hold top_p, sorted whole), {backward:g} in the
backward (with the logits' gradient in the weight's half dtype), constant in the tokens past r rows; with replayed
kept sets, [N, K] fp32 logits and gradients ({replayed_forward:g} and {replayed_backward:g} of them) beside the plain
layer-1 op's own (without gradients the op's own record sweep, for wide sets with their bitmaps a launch and no [N, K]
buffer); and the backward's fp32 gradients (dH [N, D], and dW [V, D] where the lm_head trains). The buffer
counts are measured on a CPU (tests/test_memory_sampler.py); the GPU's sort workspaces are not in them. The old
policy's pass runs one micro-batch without autograd after the update (the optimizer state held, no gradients): its
peak is accounted on its own and the head's peak is the larger of its two passes'.
"""


def _head_dim(shape: dict) -> int:
    """A report's shape's head dim: its explicit one, else hidden size / heads."""
    return shape.get("explicit_head_dim") or shape["hidden_size"] // shape["num_heads"]


def plot(report: dict, path) -> None:
    """Stacked bars by category per head, the generation phase beside them, and the card's line, as a PNG at
    ``path``. ``report``: ``to_json``'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(report["heads"].values())
    labels = [h["label"].replace(" (", "\n(") for h in heads] + ["generation\n(KV cache)"]
    colors = dict(
        zip(
            CATEGORIES + ("kv cache", "allowance"),
            [
                "#4c72b0",
                "#8172b3",
                "#da8bc3",
                "#dd8452",
                "#55a868",
                "#a1c9a4",
                "#c44e52",
                "#937860",
                "#64b5cd",
                "#dddddd",
            ],
        )
    )
    stacks = [dict(h["categories_bytes"]) | {"allowance": h["allowance_gib"] * GIB} for h in heads]
    g = report["generation"]
    stacks.append(dict(g["parts_bytes"]) | {"allowance": g["allowance_gib"] * GIB})
    fig, ax = plt.subplots(figsize=(2.2 * len(labels) + 2, 5.5))
    for name, color in colors.items():
        values = [gib(s.get(name, 0)) for s in stacks]
        if any(values):
            bottoms = [
                sum(gib(v) for k, v in s.items() if list(colors).index(k) < list(colors).index(name)) for s in stacks
            ]
            ax.bar(
                labels,
                values,
                bottom=bottoms,
                color=color,
                label=name,
                width=0.6,
                hatch="//" if name == "allowance" else None,
                edgecolor="white" if name != "allowance" else "#999",
            )
    card = report["card"]["gib"]
    ax.axhline(card, color="black", linestyle="--", linewidth=1)
    ax.text(len(labels) - 0.5, card, f" {report['card']['name']}: {card:.1f} GiB", va="bottom", ha="right", fontsize=9)
    for i, s in enumerate(stacks):
        total = sum(gib(v) for v in s.values())
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GiB at the peak (estimated + allowance)")
    ax.set_title(report["recipe"]["description"].split("; rollout")[0], fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(0, max(card, max(sum(gib(v) for v in s.values()) for s in stacks)) * 1.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
