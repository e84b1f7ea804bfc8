"""HuggingFace transformers causal LMs from a recipe (model.hf): built from a config, or loaded from a local folder;
never downloaded. The vocabulary and context length default to the data's."""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import torch
from torch import nn

from dtk.data.spec import DataSpec
from dtk.errors import DtkError

EXTRA = 'pip install -e ".[hf]"'
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Where configs keep their context length, most common first (GPT-2 maps max_position_embeddings to n_positions).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len")
# A training step needs no key/value cache: building one costs memory and time and is thrown away.
TRAINING_DEFAULTS = {"use_cache": False}
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config or a local folder: never the hub
    try:
        import transformers
    except ImportError:
        raise DtkError(f"model.hf: needs the optional extra 'hf' (transformers), which is not installed; "
                       f"install it: {EXTRA}") from None
    transformers.utils.logging.disable_progress_bar()  # bars in rank logs are noise
    return transformers


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def causal_lm_types() -> list[str]:
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _base_config(hf):
    """The model type's default config, or the folder's config.json, before the recipe's fields."""
    from transformers import AutoConfig

    if hf.path is not None:
        try:
            return AutoConfig.from_pretrained(hf.path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise DtkError(f"model.hf.path: got {hf.path!r}; transformers cannot read its config.json "
                           f"({_first_line(e)})") from None
    types = causal_lm_types()
    if hf.model_type not in types:
        close = difflib.get_close_matches(hf.model_type, types, n=3) or ["gpt2", "llama", "mistral", "qwen2"]
        raise DtkError(f"model.hf.model_type: got {hf.model_type!r}; not a transformers model type with a causal LM; "
                       f"accepted: one of {len(types)} in transformers {_transformers().__version__}, "
                       f"e.g. {', '.join(close)}")
    return AutoConfig.for_model(hf.model_type)


def make_config(hf, spec: DataSpec):
    """The config dtk builds: the base, then the data's vocabulary and context (model_type only, unless given),
    use_cache off (unless given), then the recipe's fields. Raises DtkError naming the field."""
    _transformers()
    from transformers import AutoConfig

    base = _base_config(hf)
    unknown = [k for k in hf.config if not hasattr(base, k)]
    if unknown:
        fields = sorted(k for k in base.to_dict() if not k.startswith("_"))
        raise DtkError(f"model.hf.config.{unknown[0]}: unknown field of {type(base).__name__}; accepted: its "
                       f"fields, e.g. {', '.join(fields[:16])}")
    aliases = getattr(base, "attribute_map", None) or {}
    given = {aliases.get(k, k) for k in hf.config}
    kwargs: dict = {}
    if hf.path is None:
        if hasattr(base, "vocab_size"):
            kwargs["vocab_size"] = spec.vocab_size
        context = next((aliases.get(k, k) for k in CONTEXT_KEYS if hasattr(base, k)), None)
        if context:
            kwargs[context] = spec.seq_len
    kwargs.update(TRAINING_DEFAULTS)
    kwargs = {k: v for k, v in kwargs.items() if k not in given}
    kwargs.update(hf.config)
    vocab = kwargs.get("vocab_size", getattr(base, "vocab_size", None))
    if hf.path is None and isinstance(vocab, int):
        # the model type's token ids belong to its tokenizer, not to dtk's data; out of range they only draw warnings
        for k in TOKEN_ID_KEYS:
            if k not in given and isinstance(getattr(base, k, None), int) and getattr(base, k) >= vocab:
                kwargs[k] = None
    try:
        if hf.path is not None:
            config = AutoConfig.from_pretrained(hf.path, local_files_only=True, **kwargs)
        else:
            config = AutoConfig.for_model(hf.model_type, **kwargs)
    except (ValueError, TypeError) as e:
        raise DtkError(f"model.hf.config: transformers refused it: {_first_line(e)}") from None
    _check_fits(config, spec, hf)
    return config


def _check_fits(config, spec: DataSpec, hf) -> None:
    where = " (config.json)" if hf.path is not None else ""
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < spec.vocab_size:
        raise DtkError(f"model.hf.config.vocab_size: got {vocab}{where}; the data has {spec.vocab_size} tokens; "
                       f"accepted: >= {spec.vocab_size}")
    aliases = getattr(config, "attribute_map", None) or {}
    for k in CONTEXT_KEYS:
        value = getattr(config, k, None)
        if isinstance(value, int):
            if value < spec.seq_len:
                canonical = aliases.get(k, k)  # name the field as the recipe spelled it
                name = next((u for u in hf.config if aliases.get(u, u) == canonical), canonical)
                raise DtkError(f"model.hf.config.{name}: got {value}{where}; data.seq_len is {spec.seq_len}; "
                               f"accepted: >= {spec.seq_len}")
            return


def _weights_in(path: str | None) -> bool:
    return path is not None and any((Path(path) / f).is_file() for f in WEIGHT_FILES)


def hf_constructor(hf, spec: DataSpec):
    """Builds the model from its config (model_type) in training mode, on the current default device: dtk's
    meta-device build (dtk.models.init) gives it its weights afterwards."""
    config = make_config(hf, spec)
    from transformers import AutoModelForCausalLM

    def construct() -> nn.Module:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    return construct


def pretrained_weights(hf):
    """The reader of model.hf.path's safetensors weights (dtk.models.pretrained); False when the folder holds no
    weights (a fresh init from its config), None when they are not safetensors."""
    from dtk.models.pretrained import SliceReader, safetensors_files

    files = safetensors_files(hf.path)
    if files is None:
        return None if _weights_in(hf.path) else False
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf.path, local_files_only=True)
    from transformers import AutoModelForCausalLM

    prefix = getattr(AutoModelForCausalLM._model_mapping[type(config)], "base_model_prefix", "")
    return SliceReader(files=files, prefix=prefix)


def build_hf(hf, spec: DataSpec) -> nn.Module:
    """A transformers causal LM in fp32 and training mode; the caller seeds torch (the same weights on every rank)."""
    config = make_config(hf, spec)
    from transformers import AutoModelForCausalLM

    if _weights_in(hf.path):
        model = AutoModelForCausalLM.from_pretrained(hf.path, config=config, dtype=torch.float32, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()  # from_pretrained leaves it in eval mode, which would switch dropout off


def _weights_conflict(hf, config) -> str:
    """'' when the recipe's config keeps every parameter's shape of the weights in hf.path, else the line: fields that
    change a shape (n_layer, n_embd, ...) make transformers refuse the weights on every rank (ignore_mismatched_sizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = AutoConfig.from_pretrained(hf.path, local_files_only=True)

    def shapes(c) -> dict:
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(c).state_dict().items()}

    want = shapes(saved)
    if want == shapes(config):
        return ""
    import copy

    def reshapes(k) -> bool:  # this field alone changes a shape (dropout does not, n_layer does)
        one = copy.deepcopy(saved)
        setattr(one, k, hf.config[k])
        return shapes(one) != want

    differ = [k for k, v in hf.config.items() if getattr(saved, k, None) != v and reshapes(k)]
    if not differ:
        return ""  # the shapes differ for a reason of the folder's own: transformers will say it
    first, more = differ[0], [f"{k}={hf.config[k]!r} (saved: {getattr(saved, k, None)!r})" for k in differ[1:]]
    return (f"model.hf.config.{first}: got {hf.config[first]!r}; the weights in model.hf.path {hf.path!r} were saved "
            f"with {first}={getattr(saved, first, None)!r}" + (f", and {', '.join(more)}" if more else "") +
            "; accepted: fields that keep the weights' shapes (dropout, ...), or model.hf.config={} (the folder's "
            "config.json as saved)")


def recipe_problems(r) -> list[str]:
    """What transformers would refuse in a recipe's model.hf, found before any rank starts: the model is built on
    the meta device (no memory, no weights read), and FSDP's wrap units are found in it."""
    from dtk.data import build_dataset
    from dtk.models.wrap import find_wrap_units

    try:
        spec = build_dataset(r.data, seed=r.training.seed).spec
        config = make_config(r.model.hf, spec)
        from transformers import AutoModelForCausalLM

        if _weights_in(r.model.hf.path) and r.model.hf.config and (line := _weights_conflict(r.model.hf, config)):
            return [line]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        if r.strategy.name == "fsdp" or r.strategy.wrap:
            find_wrap_units(model, names=r.strategy.wrap)
    except DtkError as e:
        return e.lines
    except (ValueError, TypeError) as e:
        return [f"model.hf.config: transformers refused it: {_first_line(e)}"]
    return []
