"""The input checks of ``memkit estimate`` and of its library functions, all made before any work.

:func:`check_tokens` bounds the batch: ``--seq-len`` and ``--batch-size`` are ints >= 1 whose product (tokens per
batch) is at most ``2**31``. :func:`read_hf_config` reads a Hugging Face ``config.json`` into its transformers
config class once what the model's memory depends on is checked: the file holds one JSON object with a
``model_type`` transformers knows; the sizes and counts (:data:`SIZE_KEYS`: vocabulary, hidden and intermediate
sizes, layers, attention and key/value heads, ``head_dim``, experts) and ``max_position_embeddings`` are ints
>= 1 where the file sets them; ``num_attention_heads`` divides ``hidden_size`` where ``head_dim`` is derived from
them (or the config class requires it), ``num_key_value_heads`` divides ``num_attention_heads`` and
``num_experts_per_tok`` is at most the number of experts. :func:`check_positions` refuses a ``--seq-len`` above
``max_position_embeddings``; :func:`check_pipeline` and :func:`check_pipeline_family` check ``--pipeline``.
A failure is one line naming the key or flag and what is allowed: a :class:`~lightning_memkit.common.errors.ConfigError`
(a ``ValueError``), which ``memkit`` prints alone, exiting with status 2.

What is used as given but is probably not meant is an :class:`InputWarning` of one line (``memkit estimate``
prints it on stderr): sizes the file leaves to the class's defaults, keys that neither the config class nor its
model know (a misspelt key).

Example::

    >>> from lightning_memkit.estimate.inputs import check_tokens
    >>> check_tokens(4096, 8)
    (4096, 8)
    >>> check_tokens(50_000_000, 64)
    Traceback (most recent call last):
    ...
    lightning_memkit.common.errors.ConfigError: --batch-size 64 x --seq-len 50000000 = 3200000000 tokens per batch: ...
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from lightning_memkit.common.validation import check_int, check_multiple

__all__ = ["InputWarning", "MAX_TOKENS", "SIZE_KEYS", "check_devices", "check_pipeline", "check_pipeline_family",
           "check_positions", "check_tokens", "read_hf_config"]

MAX_TOKENS = 2**31
#: the config keys that size the model; where a file sets one, it is an int >= 1 (``None`` where the class
#: derives it from the others), and one the file leaves to a class default is warned about
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
             "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok")
_MINIMUM = {"n_shared_experts": 0}
_CHECKED_KEYS = (*SIZE_KEYS, "max_position_embeddings")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
IGNORED_KEYS = ("_comment", "quantization_config", "torch_dtype", "dtype", "transformers_version")


class InputWarning(UserWarning):
    """An input ``memkit estimate`` uses as given that is probably not what was meant (one line)."""


def input_error(message: str) -> ValueError:
    """The :class:`~lightning_memkit.common.errors.ConfigError` of a bad input: ``memkit`` prints its one line alone."""
    from lightning_memkit.common.errors import ConfigError

    return ConfigError(message, hint=False)


def checked(check: Any, *args: Any, prefix: str = "", **kwargs: Any) -> Any:
    """``check(*args, **kwargs)`` (a check of :mod:`~lightning_memkit.common`), its ``ValueError`` raised again as
    :func:`input_error` with ``prefix`` before the message."""
    try:
        return check(*args, **kwargs)
    except ValueError as err:
        raise input_error(f"{prefix}{err}") from None


def check_tokens(seq_len: Any, batch_size: Any) -> tuple[int, int]:
    """``(seq_len, batch_size)``: ints >= 1 whose product, the tokens of a batch, is at most :data:`MAX_TOKENS`."""
    seq_len = checked(check_int, seq_len, "--seq-len", minimum=1)
    batch_size = checked(check_int, batch_size, "--batch-size", minimum=1)
    if seq_len * batch_size > MAX_TOKENS:
        raise input_error(f"--batch-size {batch_size} x --seq-len {seq_len} = {seq_len * batch_size} tokens per batch: "
                          f"at most {MAX_TOKENS} (2**31)")
    return seq_len, batch_size


def check_devices(devices: Any) -> int:
    """``--devices``: the devices the run trains on, an int >= 1 (data parallel; sharded by the ``sharding`` lever)."""
    return checked(check_int, devices, "--devices", minimum=1)


def check_pipeline(stages: Any, microbatches: Any, batch_size: int) -> int:
    """The microbatches of ``--pipeline stages`` (``None``: ``stages``): ``stages`` an int >= 2, ``microbatches`` an
    int >= 1 that divides ``batch_size`` (checked before)."""
    checked(check_int, stages, "--pipeline", minimum=2)
    microbatches = stages if microbatches is None else checked(check_int, microbatches, "--microbatches", minimum=1)
    checked(check_multiple, batch_size, "--batch-size", microbatches, "--microbatches",
            why="each microbatch holds --batch-size / --microbatches sequences")
    return microbatches


def check_pipeline_family(config: Any, path: str | Path) -> None:
    """Refuse a model that ``memkit_pipeline`` does not split: the causal LM ``config`` builds (on ``meta``) must
    have the decoder-only layout and layer kinds :func:`~lightning_memkit.hf.pipeline_stages.causal_lm_problems`
    reads, whatever its family."""
    from lightning_memkit.hf.pipeline_stages import causal_lm_config_problems

    problems = causal_lm_config_problems(config)
    if problems:
        raise input_error(f"--pipeline: model_type {config.model_type!r} of {path} is not split by memkit_pipeline: "
                          f"{'; '.join(problems)}")


def check_positions(seq_len: int, config: Any, path: str | Path) -> None:
    """Refuse a ``seq_len`` above the config's ``max_position_embeddings``: the model is built for that many
    positions (a learned position table has no more rows), and the estimate makes the positions real."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and seq_len > limit:
        raise input_error(f"--seq-len {seq_len}: at most max_position_embeddings={limit} of {path}, the positions "
                          "the model is built for; to estimate longer sequences, raise it in a copy of the config "
                          "(as a context-extension run does)")


# -- the config.json ---------------------------------------------------------------------------------------
@dataclass
class _Schema:
    """A transformers config class's keys by the attribute that stores them (``attribute_map`` resolved: GPT-2's
    ``hidden_size`` is ``n_embd``), with the class defaults and the field name each stands for."""

    cls: type
    aliases: dict[str, str]
    defaults: dict[str, Any]
    names: dict[str, str]

    @classmethod
    def of(cls, config_class: type) -> _Schema:
        aliases = dict(getattr(config_class, "attribute_map", None) or {})
        found = {aliases.get(name, name): (name, default) for name, default in _class_defaults(config_class)}
        return cls(config_class, aliases, {k: d for k, (_, d) in found.items()}, {k: n for k, (n, _) in found.items()})

    def canon(self, key: str) -> str:
        return self.aliases.get(key, key)

    def get(self, values: dict[str, Any], key: str) -> Any:
        return values.get(self.canon(key))


def _class_defaults(config_class: type) -> list[tuple[str, Any]]:
    """``(key, default)`` of a transformers config class: its dataclass fields (transformers 5), else the keyword
    arguments of its ``__init__`` (``None`` where there is no default)."""
    if is_dataclass(config_class):
        return [(f.name, f.default if f.default is not MISSING else
                 f.default_factory() if f.default_factory is not MISSING else None) for f in fields(config_class)]
    params = inspect.signature(config_class.__init__).parameters.values()
    return [(p.name, None if p.default is p.empty else p.default) for p in params
            if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def read_hf_config(path: str | Path) -> Any:
    """The transformers config of the ``config.json`` at ``path``, checked (see the module doc), without its
    quantization and dtype entries; raises :func:`input_error`, warns :class:`InputWarning`."""
    path = Path(path)
    values = _json_object(path)
    schema = _Schema.of(_config_class(values.pop("model_type", None), path))
    for key in IGNORED_KEYS:
        values.pop(key, None)
    merged = _check_values(values, schema, path)
    config = _build(values, merged, schema, path)
    _warn_keys(values, schema, config, path)
    return config


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise input_error(f"--hf-config: no such file: {path}")
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise input_error(f"--hf-config: cannot read {path}: {err}") from None
    if not isinstance(values, dict):
        raise input_error(f"--hf-config {path}: holds a JSON {type(values).__name__}; a config.json holds one object "
                          "({\"model_type\": ..., \"hidden_size\": ..., ...})")
    return values


def _config_class(model_type: Any, path: Path) -> type:
    import transformers

    if not isinstance(model_type, str) or not model_type:
        raise input_error(f"--hf-config {path}: has no model_type; must be a transformers model type such as "
                          f"'llama', got {model_type!r}")
    try:
        return transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise input_error(f"--hf-config {path}: model_type {model_type!r} is not one of transformers "
                          f"{transformers.__version__}'s model types (transformers.CONFIG_MAPPING)") from None


def _check_values(values: dict[str, Any], schema: _Schema, path: Path) -> dict[str, Any]:
    """The class defaults updated by the file's values (by field name), the sizes and their relations checked."""
    prefix = f"--hf-config {path}: "
    sized = {schema.canon(k) for k in _CHECKED_KEYS}
    for key, value in values.items():
        name = schema.canon(key)
        if name in sized:
            checked(check_int, value, key, minimum=_MINIMUM.get(name, 1),
                    allow_none=name in schema.defaults and schema.defaults[name] is None, prefix=prefix)
    merged = {**schema.defaults, **{schema.canon(k): v for k, v in values.items()}}
    heads, kv = schema.get(merged, "num_attention_heads"), schema.get(merged, "num_key_value_heads")
    if heads and kv:
        checked(check_multiple, heads, "num_attention_heads", kv, "num_key_value_heads", prefix=prefix)
    hidden = schema.get(merged, "hidden_size")
    if hidden and heads and schema.get(merged, "head_dim") is None:
        checked(check_multiple, hidden, "hidden_size", heads, "num_attention_heads", prefix=prefix,
                why="head_dim is derived as hidden_size // num_attention_heads")
    _check_experts(merged, schema, prefix)
    return merged


def _check_experts(merged: dict[str, Any], schema: _Schema, prefix: str) -> None:
    experts = next(((k, schema.get(merged, k)) for k in _EXPERT_KEYS if schema.get(merged, k)), None)
    per_token = schema.get(merged, "num_experts_per_tok")
    if experts and per_token and per_token > experts[1]:
        raise input_error(f"{prefix}num_experts_per_tok={per_token}: must be <= {experts[0]}={experts[1]} "
                          "(each token is routed to that many distinct experts)")


def _construction_errors() -> tuple[type[Exception], ...]:
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not strict dataclasses
        return ValueError, TypeError, KeyError
    return ValueError, TypeError, KeyError, StrictDataclassError


def _build(values: dict[str, Any], merged: dict[str, Any], schema: _Schema, path: Path) -> Any:
    """``schema.cls(**values)``; what the class refuses beyond these checks is one line naming the class."""
    try:
        return schema.cls(**values)
    except _construction_errors() as err:
        prefix, name = f"--hf-config {path}: ", schema.cls.__name__
        hidden, heads = schema.get(merged, "hidden_size"), schema.get(merged, "num_attention_heads")
        if hidden and heads:  # the class's own check, named by key
            checked(check_multiple, hidden, "hidden_size", heads, "num_attention_heads", prefix=prefix,
                    why=f"{name} requires it")
        raise input_error(f"{prefix}{name} refuses it: {' '.join(str(err).split())}") from None


def _warn_keys(values: dict[str, Any], schema: _Schema, config: Any, path: Path) -> None:
    """One :class:`InputWarning` for the sizes left to the class's defaults, one for the keys nothing reads."""
    given = {schema.canon(k) for k in values}
    missing = [schema.names[k] for k in dict.fromkeys(schema.canon(k) for k in SIZE_KEYS)
               if schema.defaults.get(k) is not None and k not in given]
    name = schema.cls.__name__
    if missing:
        taken = ", ".join(f"{k}={getattr(config, k)!r}" for k in missing)
        warnings.warn(InputWarning(f"--hf-config {path}: {taken} taken from {name}'s defaults (the file does not "
                                   "set them)"), stacklevel=1)
    unknown = [k for k in values if schema.canon(k) not in schema.defaults and k in vars(config)]
    if unknown:
        unknown = [k for k in unknown if k not in _instance_keys(schema.cls) and not _read_by_model(k, schema.cls)]
    if unknown:
        warnings.warn(InputWarning(f"--hf-config {path}: {', '.join(unknown)} ignored: not known to {name} or its "
                                   "model (misspelt?)"), stacklevel=1)


def _instance_keys(config_class: type) -> set[str]:
    """The attributes of a default ``config_class()`` (``_name_or_path`` and the like)."""
    try:
        return set(vars(config_class()))
    except Exception:  # a class that needs arguments: no attributes known beyond its fields
        return set()


def _read_by_model(key: str, config_class: type) -> bool:
    """Whether the modeling module of ``config_class`` names ``key`` (``getattr(config, "head_dim", ...)``)."""
    import importlib

    module = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return True  # cannot tell: not reported
    return re.search(rf"\b{re.escape(key)}\b", source) is not None
