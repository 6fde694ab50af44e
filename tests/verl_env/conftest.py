"""Tests of grpo_fast.verl: they run where verl is installed (its pins conflict with the trl extra, so CI gives them an
environment of their own; tests/test_verl.py runs this folder there). Elsewhere the folder is not collected."""

import importlib.util

if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]
