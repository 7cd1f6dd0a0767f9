"""sonar-train's checkpoints: ``--model PATH`` (a local transformers checkpoint the arms start from) and
``--save DIR`` (the sonar arm's trained model, loadable without sonar_kernels).

The data stays sonar-train's bytes (:class:`sonar_kernels.train.data.ByteData`): token ids are the UTF-8
bytes of the text, 0-255, whatever the checkpoint's tokenizer. A checkpoint's vocabulary must therefore
hold at least :data:`BYTE_VOCAB` ids (a real one holds tens of thousands; ids 256 and up are never seen);
a smaller one is refused rather than folded (bytes mod vocab would merge different bytes into one token).
The pretrained embeddings of ids 0-255 mean other tokens than these bytes, so the first losses are high:
the run measures memory, step time and the arms' agreement on a real model's shapes and weights, not a
useful fine-tune of its language.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from sonar_kernels.train.data import UsageError

# The byte values sonar-train's data uses as token ids.
BYTE_VOCAB = 256


# What the report says about the tokens of a --model run.
TOKENS_NOTE = (
    "token ids are the text's UTF-8 bytes (0-255), not the checkpoint's tokenizer; vocabulary {vocab}: "
    "ids 256 and up are never seen"
)


# The config settings sonar-train changes for training, restored to the checkpoint's values when saving.
TRAINING_SETTINGS = {
    "output_router_logits": True,  # the load-balancing loss is part of the training loss
    "use_cache": False,  # training only (and transformers warns when checkpointing meets the cache)
}


# Keys of config.json that would select the sonar experts when loaded: never written by --save.
EXPERTS_KEYS = ("experts_implementation", "_experts_implementation")


def load_config(path: str):
    """The transformers config of the checkpoint folder ``path`` (local files only, no hub access).

    Raises:
        UsageError: no such folder, no config.json, a model type this transformers does not know, or a
            vocabulary below :data:`BYTE_VOCAB`.
    """
    import transformers

    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(
            f"--model {path}: no such folder (a local checkpoint saved by save_pretrained; the hub is not reached)"
        )
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model {path}: no config.json (a folder saved by save_pretrained holds one)")
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise UsageError(f"--model {path}: transformers cannot read its config ({e})") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < BYTE_VOCAB:
        raise UsageError(
            f"--model {path}: a vocabulary of {vocab} tokens; sonar-train's data uses the {BYTE_VOCAB} byte "
            f"values as token ids, so the model needs vocab_size >= {BYTE_VOCAB}"
        )
    return config


def meta_model(config, path: str):
    """The checkpoint's causal-LM model built on the meta device (no memory): its parameter shapes for the
    memory estimate, and the check that the sonar experts can run it.

    Raises:
        UsageError: not a causal LM transformers knows, no transformers experts module (not an MoE model,
            or one whose experts do not dispatch through ExpertsInterface), or experts the kernels refuse.
    """
    import transformers

    from sonar_kernels.integrations import transformers as hf

    with _quiet_warnings(), torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            raise UsageError(
                f"--model {path}: not a causal language model transformers can build ({e})"
            ) from None
    if not any(hf.is_experts_module(m) for m in model.modules()):
        raise UsageError(
            f"--model {path}: {type(model).__name__} has no transformers experts module (an MoE model whose "
            "experts dispatch through transformers' ExpertsInterface: OLMoE, Qwen3-MoE, Granite MoE, Mixtral, ...)"
        )
    try:
        hf.check_sonar_modules(model, selected_only=False)
    except ValueError as e:
        raise UsageError(f"--model {path}: {e}") from None
    return model


def load_model(path: str, dtype: torch.dtype, quiet: bool):
    """The checkpoint at ``path``, loaded with ``from_pretrained`` on the CPU in ``dtype`` with the sonar
    experts and :data:`TRAINING_SETTINGS`. ``quiet``: no progress bar.

    Raises:
        UsageError: weights missing from the checkpoint (e.g. a base model saved without its LM head: the
            arms would start from a random head), or a checkpoint transformers cannot load.
    """
    import transformers

    with _quiet_warnings(), _progress_bars(not quiet):
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=dtype, experts_implementation="sonar",
                output_loading_info=True, **TRAINING_SETTINGS,
            )  # fmt: skip
        except (ValueError, OSError) as e:
            raise UsageError(f"--model {path}: transformers cannot load it ({e})") from None
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UsageError(
            f"--model {path}: the checkpoint lacks {', '.join(missing[:3])}{more}; the arms would start from "
            "random weights there"
        )
    return model


def saved_settings(config) -> dict:
    """The values of :data:`TRAINING_SETTINGS` in ``config`` as the checkpoint had them."""
    return {key: getattr(config, key, None) for key in TRAINING_SETTINGS}


def save_model(model, directory: str, settings: dict, quiet: bool) -> Path:
    """Save ``model`` (trained with the sonar experts) to ``directory`` with ``save_pretrained``, its
    config as it was before training (``settings``: :func:`saved_settings`, None values left as
    trained) and without any key that selects the sonar experts, so that a plain
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads it with transformers' default experts in a
    process that never imports sonar_kernels. The model is unchanged. Returns the folder."""
    folder = Path(directory)
    config = model.config
    trained = {key: getattr(config, key) for key in settings if hasattr(config, key)}
    for key, value in settings.items():
        if value is not None:
            setattr(config, key, value)
    try:
        with _quiet_warnings(), _progress_bars(not quiet):
            model.save_pretrained(folder)
    finally:
        for key, value in trained.items():
            setattr(config, key, value)
    # transformers 5.24 does not serialize the experts implementation; should a later one, a config that
    # selects "sonar" would not load where sonar_kernels is not registered.
    config_file = folder / "config.json"
    written = json.loads(config_file.read_text())
    if any(key in written for key in EXPERTS_KEYS):
        for key in EXPERTS_KEYS:
            written.pop(key, None)
        config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return folder


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """transformers' progress bars (loading and writing weights) on or off, as they were afterwards."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    if enabled:
        logging.enable_progress_bar()
    else:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()


@contextlib.contextmanager
def _quiet_warnings():
    """transformers' config and loading notices (e.g. an eos id outside a tiny vocabulary) kept off stderr."""
    import warnings

    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
