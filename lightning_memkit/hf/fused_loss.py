"""HF causal-LM loss through :func:`~lightning_memkit.ops.linear_cross_entropy`: no ``(B, T, V)`` logits.

Under ``with fused_linear_cross_entropy(model):`` a forward called with ``labels`` runs the decoder,
then computes HF's causal-LM loss (labels shifted by one, ``-100`` ignored, mean over kept tokens, or
``sum / num_items_in_batch`` when that is passed) from the final hidden states and the ``lm_head``
weight, chunk by chunk. The output's ``logits`` are ``None``. MoE models add the router auxiliary
loss exactly as their own forward does. Without ``labels`` the original forward runs unchanged.

A peft model (``PeftModel`` around the causal LM) is patched inside: its LoRA layers run as peft runs them, and
a LoRA adapter on ``lm_head`` joins the fused head: ``hidden @ W.T + scaling * B(A(dropout(hidden)))`` is one
product of ``[hidden, scaling * A(dropout(hidden))]`` with ``[W, B]`` (a copy of the head weight with the
adapters' ``B`` columns; still no logits).

Only the model *instance*'s ``forward`` is patched; it is restored on exit, exceptions included.

Example::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from lightning_memkit.hf import fused_linear_cross_entropy
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    ...                   num_key_value_heads=1, vocab_size=64)
    >>> model = LlamaForCausalLM(cfg)
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> with fused_linear_cross_entropy(model):
    ...     out = model(input_ids=ids, labels=ids)
    >>> out.logits is None, out.loss.shape
    (True, torch.Size([]))
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from lightning_memkit.common.validation import check_bool, check_choice, check_int
from lightning_memkit.hf.layers import modeling_function
from lightning_memkit.hf.peft_models import head_parts, unwrap_peft
from lightning_memkit.ops import linear_cross_entropy

__all__ = ["LOGITS_DTYPES", "find_causal_lms", "fused_linear_cross_entropy"]

_LOSS_ONLY_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _check_model(model: Any) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"fused_linear_cross_entropy(model=...): must be a transformers PreTrainedModel (or a peft "
                        f"model around one), got {type(model).__name__}")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"fused_linear_cross_entropy(model=...): {type(model).__name__} has no `lm_head` "
                        f"nn.Linear (got {type(head).__name__}); only causal LMs are supported")
    try:
        head_parts(head)
    except (TypeError, ValueError) as err:
        raise type(err)(f"fused_linear_cross_entropy(model=...): {type(model).__name__}.lm_head: {err}") from None
    if model.base_model is model:
        raise TypeError(f"fused_linear_cross_entropy(model=...): {type(model).__name__} has no base model")
    if _router_aux_enabled(model, None) and _aux_loss_fn(model) is None:
        raise ValueError(f"fused_linear_cross_entropy(model=...): config.output_router_logits=True but "
                         f"{type(model).__module__} has no load_balancing_loss_func to reproduce the aux loss")


def _aux_loss_fn(model: Any):
    return modeling_function(model, "load_balancing_loss_func")


def _router_aux_enabled(model: Any, requested: bool | None) -> bool:
    if requested is not None:
        return bool(requested)
    return bool(getattr(model.config, "output_router_logits", False))


def _bind(original, args: tuple, kwargs: dict) -> dict:
    """All call arguments by name (``**kwargs`` flattened)."""
    sig = inspect.signature(original)
    bound = sig.bind(*args, **kwargs)
    params = dict(bound.arguments)
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            params.update(params.pop(p.name, {}))
    return params


#: ``logits_dtype`` of the fused HF loss (passed to ``linear_cross_entropy`` as it is): ``"head"`` rounds each logit
#: to the head's dtype as transformers does, ``"float32"`` keeps the logits (and their gradient) in float32.
LOGITS_DTYPES = ("head", "float32")


@dataclasses.dataclass(frozen=True)
class _Settings:
    chunk_size: int | str
    backend: str
    logits_dtype: str
    token_accuracy: bool


def _lm_loss(model, hidden, labels, params, settings: _Settings) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF ``ForCausalLMLoss`` on ``hidden @ lm_head.weight.T`` without the logits; and the token accuracy."""
    ignore_index = params.get("ignore_index", -100)
    shift_labels = params.get("shift_labels")
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    n_items = params.get("num_items_in_batch")
    hidden, weight, bias = _head_operands(model.lm_head, hidden.reshape(-1, hidden.shape[-1]))
    out = linear_cross_entropy(
        hidden, weight, shift_labels.reshape(-1).to(hidden.device),
        bias=bias, ignore_index=ignore_index, softcap=getattr(model.config, "final_logit_softcapping", None),
        reduction="mean" if n_items is None else "sum", chunk_size=settings.chunk_size, backend=settings.backend,
        logits_dtype=settings.logits_dtype, return_accuracy=settings.token_accuracy,
    )
    loss, accuracy = out if settings.token_accuracy else (out, None)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    return loss, accuracy


def _head_operands(head, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden, weight, bias)`` whose ``hidden @ weight.T + bias`` are the head's logits, LoRA adapters included:
    each active adapter adds ``scaling * A(dropout(hidden))`` columns to ``hidden`` and its ``B`` to ``weight``."""
    if any(getattr(getattr(h, "func", h), "__name__", "") == "_adapter_names_pre_forward_hook"
           for m in head.modules() for h in m._forward_pre_hooks.values()):
        raise ValueError("fused_linear_cross_entropy: the call passes peft's adapter_names (a different adapter per "
                         "sample) and lm_head has LoRA layers; the fused head runs the active adapters only: call "
                         "without adapter_names, or outside the fused loss")
    parts = head_parts(head)
    if not parts.adapters:
        return hidden, parts.weight, parts.bias
    weight, bias = parts.weight, parts.bias
    columns, rows = [hidden], [weight]
    for a in parts.adapters:
        x = hidden.to(a.A.weight.dtype) if parts.cast_input and hidden.is_floating_point() else hidden
        columns.append((a.A(a.dropout(x)) * a.scaling).to(hidden.dtype))
        rows.append(a.B.weight.to(weight.dtype))
        if a.B.bias is not None:
            extra = (a.B.bias * a.scaling).to(weight.dtype)
            bias = extra if bias is None else bias + extra
    return torch.cat(columns, dim=-1), torch.cat(rows, dim=1), bias


def _aux_loss(model, router_logits, attention_mask) -> torch.Tensor:
    return _aux_loss_fn(model)(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def _cache_field(output_type: type) -> str:
    """The KV-cache field of a transformers output class: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    names = {f.name for f in dataclasses.fields(output_type)}
    return "cache" if "cache" in names else "past_key_values"


def _fused_forward(model, params: dict, labels, settings: _Settings):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    logits_to_keep = params.pop("logits_to_keep", 0)
    return_dict = params.pop("return_dict", None)
    loss_kwargs = {k: params.pop(k) for k in _LOSS_ONLY_KWARGS if k in params}
    moe = hasattr(model.config, "output_router_logits")
    router = _router_aux_enabled(model, params.pop("output_router_logits", None))
    if moe:
        params["output_router_logits"] = router
    outputs = model.base_model(**params)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    loss, accuracy = _lm_loss(model, hidden, labels, loss_kwargs, settings)
    cache = _cache_field(type(outputs))
    common = dict(loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    common[_cache_field(CausalLMOutputWithPast)] = getattr(outputs, cache)
    if moe:
        aux = _aux_loss(model, outputs.router_logits, params.get("attention_mask")) if router else None
        if aux is not None:
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        common["loss"] = loss
        out = MoeCausalLMOutputWithPast(aux_loss=aux, router_logits=outputs.router_logits, **common)
    else:
        out = CausalLMOutputWithPast(**common)
    if accuracy is not None:
        out.token_accuracy = accuracy  # an attribute, not a field: ``to_tuple()`` and indexing are transformers'
    return out.to_tuple() if return_dict is False else out


@contextlib.contextmanager
def fused_linear_cross_entropy(
    model: Any, *, chunk_size: int | str = "auto", backend: str = "auto", logits_dtype: str = "head",
    token_accuracy: bool = False,
) -> Iterator[Any]:
    """Within the block, ``model(..., labels=...)`` computes its loss without materializing the logits.

    Args:
        model: a transformers causal LM (``PreTrainedModel`` with an ``lm_head`` and a base model), or a peft
            model around one (its LoRA adapters on ``lm_head`` included).
        chunk_size: tokens per chunk of :func:`~lightning_memkit.ops.linear_cross_entropy`, or ``"auto"``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (as in ``linear_cross_entropy``).
        logits_dtype: ``"head"`` (default): transformers' numerics, each logit rounded to the head's dtype
            (bf16/fp16 heads; ``final_logit_softcapping`` in that dtype), a float32 loss, the logits' gradient
            rounded to the head's dtype: its losses are transformers' to float32 rounding. ``"float32"``: the
            logits and their gradient kept in float32 (more exact, not transformers' numbers). The same for
            float32 heads.
        token_accuracy: the output gets a ``token_accuracy`` attribute, the fraction of the kept (shifted)
            labels that the logits' argmax predicts, computed chunk by chunk (no logits).

    Yields the model. ``config.final_logit_softcapping`` is applied as ``softcap``; MoE router aux
    loss (``output_router_logits``) is added as HF does. See the module docstring for an example.
    """
    outer, model = model, unwrap_peft(model)
    _check_model(model)
    check_int(chunk_size, "chunk_size", minimum=1, also=("auto",), owner="fused_linear_cross_entropy")
    check_choice(backend, "backend", ("auto", "torch", "triton"), owner="fused_linear_cross_entropy")
    check_choice(logits_dtype, "logits_dtype", LOGITS_DTYPES, owner="fused_linear_cross_entropy")
    check_bool(token_accuracy, "token_accuracy", owner="fused_linear_cross_entropy")
    settings = _Settings(chunk_size, backend, logits_dtype, token_accuracy)
    had_own = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    original = model.forward

    def forward(*args, **kwargs):
        params = _bind(original, args, kwargs)
        labels = params.pop("labels", None)
        if labels is None:
            return original(*args, **kwargs)
        return _fused_forward(model, params, labels, settings)

    model.forward = forward
    try:
        yield outer
    finally:
        if had_own:
            model.forward = previous
        else:
            del model.forward


def _unwrap(module: Any) -> Any:
    """The model inside ``torch.compile``'s wrapper (``OptimizedModule``: the module it compiles) and peft's."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        module = module._orig_mod  # the wrapped module; patching its forward recompiles the wrapper
    return unwrap_peft(module)


def find_causal_lms(pl_module: Any) -> list[Any]:
    """The HF causal LMs of ``pl_module``: itself if it is a ``PreTrainedModel``, else its attributes that are;
    a peft model (``PeftModel``) or a ``torch.compile``-d one in either place stands for the causal LM inside it."""
    from transformers import PreTrainedModel

    inner = _unwrap(pl_module)
    if isinstance(inner, PreTrainedModel):
        return [inner]
    found = [m for m in map(_unwrap, vars(pl_module).get("_modules", {}).values())
             if isinstance(m, PreTrainedModel) and hasattr(m, "lm_head")]
    found = list({id(m): m for m in found}.values())  # one model held twice (itself and compiled) is patched once
    if not found:
        raise ValueError(f"FusedLinearCrossEntropy: {type(pl_module).__name__} is not a transformers PreTrainedModel "
                         "and has no attribute that is a PreTrainedModel with an `lm_head` (or a peft model around "
                         "one)")
    return found
