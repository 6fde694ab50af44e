#!/usr/bin/env bash
# GRPO on GSM8K with verl 0.9, grpo_fast as verl's fused LM head: use_fused_kernels=True and
# fused_kernel_options.impl_backend=grpo_fast are the whole change against a verl GRPO run. One GPU node (MODEL and
# NGPUS below); verl's FSDP2 engine, vLLM rollout.
#
#   pip install "grpo_fast[verl]" vllm        # or verl's docker image, then pip install "grpo_fast[verl]"
#   bash examples/verl_gsm8k.sh               # extra key=value arguments override the config, as in verl's examples
#
# Not run here (this repository has had no GPU); its data step and its config (composed with verl 0.9.1's own
# config) are tested on a CPU by tests/verl_env/test_verl_example.py.

set -xeuo pipefail

DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
NGPUS=${NGPUS:-1}

python3 "$(dirname "$0")/verl_gsm8k_data.py" --local_save_dir "$DATA"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$DATA/train.parquet \
    data.val_files=$DATA/test.parquet \
    data.train_batch_size=128 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.use_fused_kernels=True \
    actor_rollout_ref.model.fused_kernel_options.impl_backend=grpo_fast \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger=['console'] \
    trainer.project_name='grpo_fast_verl_gsm8k' \
    trainer.experiment_name='qwen2_5_1_5b_grpo_fast' \
    trainer.n_gpus_per_node=$NGPUS \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=5 \
    trainer.total_epochs=1 "$@"
