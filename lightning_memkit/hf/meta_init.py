"""Recompute the non-persistent buffers of a transformers model built on the meta device, as transformers does.

A model built under ``torch.device("meta")`` has its rotary embedding's ``inv_freq`` and
``original_inv_freq`` on meta too; no checkpoint holds them (``persistent=False``). ``from_pretrained``
allocates them on the device and runs the model's ``_init_weights`` on their module, whose rotary branch
calls the rope init function of the config (``rope_type``: default, yarn, ...). :func:`init_hf_buffers`
does the same for the buffers it is given: every other parameter and buffer of those modules is flagged
``_is_hf_initialized`` during the call, so transformers' guarded init functions leave them alone, and the
flags are put back afterwards. Python attributes computed in ``__init__`` (``attention_scaling``) do not
depend on the device and are already right.

:func:`lightning_memkit.loading.load_mxfp4_into` uses it by default for a module that is or holds a
transformers model (:func:`default_buffer_init`, also the rule of ``MXFP4CheckpointLoader``)::

    import torch, transformers
    from lightning_memkit.loading import load_mxfp4_into

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    load_mxfp4_into(model, "gpt-oss-20b/", device="cuda")   # init_buffers=init_hf_buffers, implied
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["init_hf_buffers", "holds_hf_model", "default_buffer_init"]

_FLAG = "_is_hf_initialized"
_UNSET = object()


def holds_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is or holds a transformers ``PreTrainedModel`` (``False`` if transformers is not imported)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return base is not None and any(isinstance(m, base) for m in module.modules())


def default_buffer_init(module: nn.Module) -> Callable[[nn.Module, Sequence[str]], None] | None:
    """The ``init_buffers`` of ``load_mxfp4_into`` when none is given: :func:`init_hf_buffers` if ``module`` is or
    holds a transformers model, else ``None`` (its meta non-persistent buffers are then refused by name)."""
    return init_hf_buffers if holds_hf_model(module) else None


def _owner(module: nn.Module, path: str, name: str):
    """The innermost ``PreTrainedModel`` on the way from ``module`` to the submodule at ``path``."""
    from transformers import PreTrainedModel

    owner = module if isinstance(module, PreTrainedModel) else None
    current = module
    for part in path.split(".") if path else ():
        current = getattr(current, part)
        if isinstance(current, PreTrainedModel):
            owner = current
    if owner is None:
        raise ValueError(f"{name}: no transformers PreTrainedModel holds it, so its _init_weights cannot recompute it")
    return owner


def _group(module: nn.Module, names: Sequence[str]) -> dict[str, list[str]]:
    """Buffer names by the path of the module that owns them."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        path, _, attr = name.rpartition(".")
        groups[path].append(attr)
    return groups


@contextlib.contextmanager
def _only_unflagged(sub: nn.Module, attrs: Sequence[str]) -> Iterator[None]:
    """Flag every direct tensor of ``sub`` except ``attrs`` as initialised; put the flags back on exit."""
    tensors = [t for n, t in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
               if n not in attrs]
    saved = [(t, getattr(t, _FLAG, _UNSET)) for t in tensors]
    targets = [sub._buffers[a] for a in attrs]
    saved += [(t, getattr(t, _FLAG, _UNSET)) for t in targets]
    try:
        for t in tensors:
            setattr(t, _FLAG, True)
        for t in targets:
            setattr(t, _FLAG, False)
        yield
    finally:
        for t, value in saved:
            if value is _UNSET:
                with contextlib.suppress(AttributeError):
                    delattr(t, _FLAG)
            else:
                setattr(t, _FLAG, value)


def init_hf_buffers(module: nn.Module, names: Sequence[str]) -> None:
    """Fill the (allocated, uninitialised) buffers ``names`` of ``module`` with the model's own ``_init_weights``.

    Each buffer's module is passed to ``_init_weights`` of the innermost ``PreTrainedModel`` holding it (as
    ``from_pretrained`` does after a load), with every other tensor of that module protected. ``ValueError``
    naming the buffer when no ``PreTrainedModel`` holds it. Example::

        >>> import torch, transformers
        >>> from lightning_memkit.demo.hf_models import tiny_hf_config
        >>> from lightning_memkit.hf.meta_init import init_hf_buffers
        >>> with torch.device("meta"):
        ...     model = transformers.GptOssForCausalLM(tiny_hf_config("gpt_oss"))
        >>> rope = model.model.rotary_emb
        >>> rope.inv_freq = torch.empty_like(rope.inv_freq, device="cpu")
        >>> rope.original_inv_freq = torch.empty_like(rope.original_inv_freq, device="cpu")
        >>> init_hf_buffers(model, ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"])
        >>> reference = transformers.GptOssForCausalLM(tiny_hf_config("gpt_oss")).model.rotary_emb
        >>> torch.equal(rope.inv_freq, reference.inv_freq)
        True
    """
    from transformers import initialization as init

    groups = _group(module, names)
    owners = {path: _owner(module, path, f"{path}.{attrs[0]}" if path else attrs[0]) for path, attrs in groups.items()}
    for path, attrs in groups.items():
        sub = module.get_submodule(path)
        with torch.no_grad(), init.guard_torch_init_functions(), _only_unflagged(sub, attrs):
            owners[path]._init_weights(sub)
