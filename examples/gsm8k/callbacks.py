"""transformers ``TrainerCallback``s for examples/trl_gsm8k.py: what TRL's trainer leaves out on a small machine.

    trainer = GRPOTrainer(..., callbacks=[MetricsFile("out/metrics.jsonl"), StepProgress(model)])

``MetricsFile`` appends every log (TRL's metrics of each step) to a jsonl file as it comes. ``StepProgress`` shows a
bar for each optimizer step that says what runs (sampling, scoring log-probs, forward / backward) and its time,
redrawn every second: TRL's own bar moves once per step, and on a CPU one step's forward / backward alone takes a
minute.
"""

from __future__ import annotations

import json
import threading

import torch
from transformers import TrainerCallback

from gsm8k import progress

__all__ = ["MetricsFile", "StepProgress"]


class MetricsFile(TrainerCallback):
    """Each ``on_log`` as one json line ``{"step": global_step, **logs}`` in ``path`` (created empty)."""

    def __init__(self, path):
        self.path = path
        open(path, "w").close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


class StepProgress(TrainerCallback):
    """A bar per optimizer step: the phase the model is in and the seconds so far, redrawn every ``refresh_s``.

    The phase comes from ``model.generate`` ("sampling", while it runs) and a forward pre-hook on ``model``'s decoder
    (every path calls it as a module, a peft model's too): with gradients, "forward / backward"; without, outside
    ``generate``, "scoring log-probs" (the old policy's or the reference's pass).
    """

    def __init__(self, model, refresh_s=1.0, file=None):
        self.refresh_s, self.file = refresh_s, file
        self.phase, self.bar, self.stop, self.generating = "starting", None, None, False
        from grpo_fast.integrations.hidden_states import decoder_of

        self.hook = decoder_of(model).register_forward_pre_hook(self._see_forward)
        generate = model.generate  # the class's, or a wrapper already there (rollout.show_generation_progress)

        def generate_and_say_so(*args, **kwargs):
            self.generating, self.phase = True, "sampling"
            try:
                return generate(*args, **kwargs)
            finally:
                self.generating = False

        model.generate = generate_and_say_so

    def _see_forward(self, module, args):
        if torch.is_grad_enabled():
            self.phase = "forward / backward"
        elif not self.generating:
            self.phase = "scoring log-probs"

    def on_step_begin(self, args, state, control, **kwargs):
        self.phase = "starting"
        total = f"/{state.max_steps}" if state.max_steps > 0 else ""
        self.step_name = f"optimizer step {state.global_step + 1}{total}"
        # a terminal: a bar redrawn with the phase; a file or a pipe: one line when the step ends (gsm8k.progress)
        self.bar = progress.bar(
            desc=self.step_name, total=1, unit="step", bar_format="{desc} ({elapsed})", file=self.file
        )
        self.stop = threading.Event()
        if progress.on_terminal(self.file):
            threading.Thread(target=self._tick, args=(self.bar, self.stop), daemon=True).start()

    def _tick(self, bar, stop):
        while not stop.wait(self.refresh_s):
            bar.set_description_str(f"{self.step_name}: {self.phase}", refresh=False)
            bar.refresh()

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.stop.set()
            self.bar.update(1)
            self.bar.close()
            self.bar = None

    def on_train_end(self, args, state, control, **kwargs):
        self.on_step_end(args, state, control)
        self.hook.remove()
