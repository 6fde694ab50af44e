"""The GSM8K recipe's helpers, on top of the loss (nothing in grpo_fast's top level imports them).

    from grpo_fast.gsm8k import data, rewards, rollout, tokenizer

| module | what |
|---|---|
| ``data`` | GSM8K from the hub (``openai/gsm8k``) or local jsonl files, the demo's system prompt, the gold answer |
| ``rewards`` | the GRPO demo's five reward functions in TRL's calling convention |
| ``rollout`` | sampling with ``model.generate``, the completion mask, group advantages, completion hidden states |
| ``tokenizer`` | an offline byte-level ChatML tokenizer (random-init runs, tests) |
"""
