"""examples/step_report.py: a run's steps (time by phase, the loss head's share) and its peak memory beside the
memory tool's estimate, as markdown."""

import json

import step_report


def test_steps_shares_and_peak_beside_the_estimate(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    phases = {"time/generation_s": 30.0, "time/logprobs_s": 2.0, "time/policy_fwd_bwd_s": 8.0, "time/optimizer_s": 0.5}
    rows = [dict(step=1, step_time_s=41.0, **phases, **{"time/head_s": 0.8}), dict(step=2, step_time_s=40.5, **phases)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    memory = tmp_path / "memory.jsonl"
    peaks = {"generation": 5.1, "logprobs": 4.0, "policy_fwd_bwd": 6.3, "optimizer": 4.2}
    memory.write_text(
        json.dumps(dict(status="other run")) + "\n" + json.dumps(dict(status="ok", peak_allocated_gb=peaks))
    )
    estimate = tmp_path / "estimate.json"
    head = dict(label="grpo_fast (Triton path)", peak_gib=6.0, with_allowance_gib=7.7, peak_in="model backward")
    estimate.write_text(json.dumps(dict(heads=dict(grpo_fast=head))))
    step_report.main(
        [str(run), "--memory-report", str(memory), "--estimate", str(estimate), "--out", str(tmp_path / "r.md")]
    )
    text = (tmp_path / "r.md").read_text()
    assert "| 1 | 41.00 | 30.00 | 2.00 | 8.00 | 0.50 | 0.80 | 10.0 % | 2.0 % |" in text
    assert "| 2 | 40.50 | 30.00 | 2.00 | 8.00 | 0.50 |  |  |  |" in text  # a run without the head's time
    assert "status ok" in text and "| 5.10 | 4.00 | 6.30 | 4.20 |" in text
    assert "6.00 GiB (7.70 with the allocator's allowance), in model backward; measured: 6.30 GiB (1.05x" in text
