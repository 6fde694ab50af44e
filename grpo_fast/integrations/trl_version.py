"""The TRL releases grpo_fast's TRL integration runs with, and TRL imported only within them (``import_pinned``):
every module of the integration (``trl``, ``trl_distillation``, ``trl_served``) takes TRL from here."""

from grpo_fast.integrations.hf import import_pinned

_TRL_LOW, _TRL_END = "1.16", "1.17"
TRL_VERSIONS = f">={_TRL_LOW},<{_TRL_END}"

trl = import_pinned("trl", _TRL_LOW, _TRL_END)
