"""Pipeline stages of a Hugging Face causal LM: ``strategy="memkit_pipeline"`` without the layer protocol.

:func:`causal_lm_stages` cuts a transformers decoder-only ``<Family>ForCausalLM`` (``.model.embed_tokens``,
``.model.layers``, ``.model.norm``, ``.model.rotary_emb``, ``.lm_head``) into pipeline layers that share the
model's own modules (nothing is copied, so a checkpoint keeps HF's parameter names), and gives the batch
split and the loss that go with them. :func:`find_causal_lm` finds such a model inside a LightningModule.

Which models: any family, read from the model rather than from a list of names. The layers are driven as the
family's own ``*Model.forward`` drives them: its embedding module (a scale inside it included, as Gemma's
``sqrt(hidden)``), each decoder layer with the mask of its own kind (``config.layer_types``, else
``config.sliding_window`` / ``config.attention_chunk_size``, transformers' own rule), the rotary ``cos``/``sin``
of its kind (one pair per kind when ``rotary_emb`` takes a ``layer_type``, as Gemma3's local and global
rotaries), the final norm, the head with ``config.final_logit_softcapping``, and the family's router auxiliary
loss where ``config.output_router_logits`` is on and the family defines ``load_balancing_loss_func``. What
:func:`causal_lm_problems` refuses, naming it: a model without that layout (no ``.model.layers`` list, an
encoder-decoder), a layer kind that is not attention (``linear_attention``, ...), a mask kind the family's
modeling module never builds, bidirectional attention. Then, on a model with real weights,
:func:`causal_lm_stages` runs the model and its stages once on a probe batch (2 x 8 tokens, or past a sliding
window or chunk below 62 tokens; one row padded; evaluation mode, no gradients) and refuses logits or a loss that
differ: a family
whose outer forward does more than this (an embedding or logit multiplier in ``*Model.forward``, say) is refused
instead of trained on another function. :data:`TESTED_MODEL_TYPES` lists the families the tests train.

=====================  ======================================================  ===================================
layer                  runs                                                    passes on
=====================  ======================================================  ===================================
``Embedding``          ``embed_tokens``; ``rotary_emb`` once per microbatch    hidden, padding mask, cos, sin
                       (and per layer type with per-type rotaries)             (per type) (+ router statistics)
``DecoderLayer`` x L   one decoder layer, with the attention mask HF gives it  the same, hidden and statistics new
``FinalNorm``          ``norm``                                                hidden (+ router statistics)
``Head``               ``lm_head`` and the final-logit softcap (skipped with   logits or hidden (+ statistics)
                       ``fused_loss=True``: the loss applies both)
=====================  ======================================================  ===================================

Choices (and their cost):

* **Rotary embedding: computed once, carried.** ``cos``/``sin`` are computed on the embedding stage from the
  position ids, as HF computes them once per forward, and passed on. So ``rotary_emb`` (buffers only, no
  parameters) belongs to one layer and is never duplicated, and all layers of a stage use the same two
  tensors (one copy kept for backward per stage, where per-layer recomputation would keep one per layer).
  Cost: ``2 * T * head_dim`` elements per microbatch per stage boundary (positions are shared by the rows), per
  layer type where the rotary depends on it (Gemma3: two pairs).
  The position ids themselves (``arange(T)``, as HF makes them) are rebuilt by each layer, not carried: torch's
  shape inference runs every stage but the first once on uninitialized tensors, and no received integer may
  then be used as an index.
* **Attention masks: the 2-D padding mask is carried, the 4-D masks are rebuilt.** Each stage builds the masks
  its layers need with ``transformers.masking_utils.create_causal_mask``, ``create_sliding_window_causal_mask``
  or ``create_chunked_causal_mask`` (per ``config.layer_types``, else per ``config.sliding_window`` or
  ``config.attention_chunk_size``, as ``create_masks_for_generate`` chooses), once per stage call and kind
  (:func:`~lightning_memkit.pipeline.runtime.stage_scratch`). A batch without ``attention_mask`` carries ones, for
  which HF builds the same masks as for none. Cost: ``B * T`` int64 per microbatch per boundary, and one mask
  construction per stage (carrying ``(B, 1, T, T)`` masks would send ``T`` times as many elements).
* **Loss: HF's, over the whole batch.** Labels shifted by one, ``-100`` ignored, the mean over the valid tokens
  of the *batch*: each microbatch contributes its token-loss sum divided by the batch's valid-token count
  (:class:`CausalLMLoss`, a :class:`~lightning_memkit.pipeline.runtime.BatchLoss`). ``fused_loss=True`` computes
  it with :func:`~lightning_memkit.ops.linear_cross_entropy` from the final hidden states (no logits).
* **Router auxiliary loss** (``config.output_router_logits``): every MoE layer adds its router statistics, per
  expert the (padding-masked) count of top-k assignments and sum of router probabilities plus the row count, to
  a ``2 * num_experts + 1`` float32 tensor carried to the last stage. HF's ``load_balancing_loss_func`` is
  ``num_experts * sum_e (count_e / rows) * (prob_e / rows)`` over these sums (checked against the model's own
  function when the stages are built), so the reported loss is HF's to rounding. Only the probabilities carry
  a gradient, weighted by the counts of the *whole batch*, which are known only once its last microbatch ran
  forward, while 1F1B runs the first backward before that. ``router_aux="exact"`` (default) therefore runs the
  batch forward once without gradients before the schedule to count the experts (``observes_forward`` of
  :class:`~lightning_memkit.pipeline.runtime.BatchLoss`): HF's gradient exactly, for one more forward pass per
  training step. ``router_aux="microbatch"`` skips that pass: each microbatch back-propagates its own aux
  loss (HF's formula on its own statistics), averaged over the microbatches, which is the gradient HF computes
  with gradient accumulation over microbatch-sized batches (and HF's exactly with one microbatch). Dropout
  before a router would route the extra pass differently: none of the tested families has any by default.
  A family without ``load_balancing_loss_func`` (DeepSeek-V3) adds no aux loss in HF, whatever its config says,
  and none here.

Batches are dicts with ``input_ids`` and ``labels`` (``(B, T)`` integer tensors) and an optional
``attention_mask``; other keys are refused.

Example (one process: the stages in a row give HF's own loss, router aux loss included)::

    >>> import torch
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.hf.pipeline_stages import causal_lm_stages
    >>> from lightning_memkit.pipeline.runtime import LayerChain
    >>> model = tiny_hf_causal_lm("qwen3_moe", seed=0)
    >>> stages = causal_lm_stages(model)
    >>> [type(layer).__name__ for layer in stages.layers]
    ['Embedding', 'DecoderLayer', 'DecoderLayer', 'FinalNorm', 'Head']
    >>> ids = torch.randint(0, 256, (2, 16))
    >>> batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    >>> inputs, labels = stages.inputs(batch)
    >>> loss = stages.loss.whole(LayerChain(*stages.layers)(*inputs), labels)
    >>> torch.allclose(loss, model(**batch).loss, atol=1e-6)
    True
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memkit.common.validation import check_bool, check_choice
from lightning_memkit.hf.layers import modeling_function
from lightning_memkit.ops import cross_entropy, linear_cross_entropy
from lightning_memkit.pipeline.runtime import BatchLoss, LayerChain, stage_scratch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TESTED_MODEL_TYPES",
    "CausalLMLoss",
    "CausalLMStages",
    "DecoderLayer",
    "Embedding",
    "FinalNorm",
    "Head",
    "causal_lm_config_problems",
    "causal_lm_inputs",
    "causal_lm_problems",
    "causal_lm_stages",
    "find_causal_lm",
    "router_aux_loss",
    "router_statistics",
]

#: ``config.model_type`` of the families the tests train under the pipeline (stage by stage against HF in one
#: process, and on 2 ranks against a plain Trainer). Any other decoder-only causal LM that
#: :func:`causal_lm_problems` accepts and whose stages reproduce it on the probe batch is split too.
TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "gemma2",
                      "gemma3_text", "phi3", "qwen2_moe", "olmoe", "deepseek_v3")
#: The earlier name of :data:`TESTED_MODEL_TYPES` (support is no longer a list of names).
SUPPORTED_MODEL_TYPES = TESTED_MODEL_TYPES
IGNORE_INDEX = -100
ROUTER_AUX_MODES = ("exact", "microbatch")
#: The attention-mask kinds a decoder layer may have, and the ``transformers.masking_utils`` function of each.
MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
                 "chunked_attention": "create_chunked_causal_mask"}
_BATCH_KEYS = ("input_ids", "labels", "attention_mask")
_LAYOUT = (("embed_tokens", nn.Embedding), ("layers", nn.ModuleList), ("norm", nn.Module), ("rotary_emb", nn.Module))
_PROBE_TOKENS = 8
_PROBE_MAX_TOKENS = 64


# -- finding the model -----------------------------------------------------------------------------------
def _pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if transformers is imported (a module holding HF models has imported it)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return PreTrainedModel


def find_causal_lm(module: nn.Module) -> tuple[str, nn.Module]:
    """``(name, model)`` of the one transformers causal LM in ``module`` (``module`` itself has name ``""``).

    Raises ``LookupError`` saying why there is none: transformers not imported, no ``PreTrainedModel`` among the
    modules, more than one, or one whose layout or configuration cannot be split (:func:`causal_lm_problems`).
    """
    base = _pretrained_model_class()
    if base is None:
        raise LookupError("it holds no transformers model (transformers is not imported)")
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, base) and not any(name.startswith(outer + ".") or outer == "" for outer, _ in found):
            found.append((name, sub))
    if not found:
        raise LookupError("it holds no transformers PreTrainedModel")
    if len(found) > 1:
        names = ", ".join(repr(n) for n, _ in found)
        raise LookupError(f"it holds {len(found)} transformers models ({names}); the pipeline splits exactly one")
    name, model = found[0]
    problems = causal_lm_problems(model)
    if problems:
        raise LookupError(f"{name or 'it'} ({type(model).__name__}) cannot be split: {'; '.join(problems)}")
    return name, model


def causal_lm_problems(model: nn.Module) -> list[str]:
    """What keeps ``model`` from being split into :func:`causal_lm_stages` (empty when nothing does).

    Read from the model, whatever its family: the decoder-only layout (``.model.embed_tokens``, a
    ``.model.layers`` list, ``.model.norm``, a ``.model.rotary_emb`` without parameters, an ``nn.Linear``
    ``.lm_head``), one attention-mask kind per layer among :data:`MASK_BUILDERS`, causal attention, and the
    router statistics where the aux loss is on. This check reads no weights (a model on ``meta`` is fine); the
    numeric check is the probe of :func:`causal_lm_stages`.
    """
    base = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return [f"config.is_encoder_decoder=True ({type(model).__name__} is an encoder-decoder model; the pipeline "
                "splits decoder-only causal LMs)"]
    problems = [f"no .model.{attr} ({kind.__name__})" for attr, kind in _LAYOUT
                if not isinstance(getattr(base, attr, None), kind)]
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        problems.append("no .lm_head (nn.Linear)")
    if config is None:
        problems.append("no .config")
    if problems:
        return problems
    return _config_problems(model, base, config)


def causal_lm_config_problems(config: Any) -> list[str]:
    """:func:`causal_lm_problems` of the causal LM that ``config`` (a transformers config) builds, built on
    ``meta`` (no memory, no weights): what ``memkit estimate --pipeline`` checks before any work."""
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        return [f"config.is_encoder_decoder=True (model_type {config.model_type!r} is an encoder-decoder model; the "
                "pipeline splits decoder-only causal LMs)"]
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - reported as the reason, naming the config's family
        first = str(err).splitlines()[0] if str(err) else ""
        return [f"transformers builds no causal LM from this model_type {config.model_type!r} config "
                f"({type(err).__name__}: {first[:200]})"]
    return causal_lm_problems(model)


def _config_problems(model: nn.Module, base: nn.Module, config: Any) -> list[str]:
    problems = []
    if len(base.layers) != config.num_hidden_layers:
        problems.append(f".model.layers holds {len(base.layers)} layers, config.num_hidden_layers="
                        f"{config.num_hidden_layers}")
    if any(True for _ in base.rotary_emb.parameters()):
        problems.append(".model.rotary_emb has parameters (it would be trained on one stage only)")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("config.use_bidirectional_attention=True (the stages build causal masks)")
    try:
        kinds = _layer_kinds(config, len(base.layers))
        _check_mask_builders(base, config, kinds)
        if _aux_enabled(model):
            _router_spec(model)
    except ValueError as err:
        problems.append(str(err))
    return problems


def _check_mask_builders(base: nn.Module, config: Any, kinds: Sequence[str]) -> None:
    """Refuse a layer kind whose mask the family never builds: its modeling module (where ``base``'s class lives)
    imports each ``transformers.masking_utils`` function it calls, so a sliding or chunked kind read from a config
    that merely carries ``sliding_window`` (or ``attention_chunk_size``) is caught here."""
    module = sys.modules.get(type(base).__module__)
    missing = sorted({kind for kind in kinds if kind != "full_attention" and module is not None
                      and getattr(module, MASK_BUILDERS[kind], None) is None})
    if missing:
        source = ("config.layer_types" if getattr(config, "layer_types", None) is not None else
                  " / ".join(f"config.{key}" for key in ("sliding_window", "attention_chunk_size")
                             if getattr(config, key, None) is not None))
        raise ValueError(f"{source} gives layers {' and '.join(missing)} masks, but {module.__name__} never builds "
                         f"them ({', '.join(MASK_BUILDERS[k] for k in missing)})")


def _layer_kinds(config: Any, n: int) -> list[str]:
    """The attention-mask kind of each decoder layer, as transformers chooses it (``create_masks_for_generate``)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        if getattr(config, "sliding_window", None) is not None:
            return ["sliding_attention"] * n
        if getattr(config, "attention_chunk_size", None) is not None:
            return ["chunked_attention"] * n
        return ["full_attention"] * n
    kinds = list(types)[:n]
    if len(kinds) < n:
        raise ValueError(f"config.layer_types names {len(kinds)} layers, the model has {n}")
    bad = sorted({f"{kind!r} (layer {i})" for i, kind in enumerate(kinds) if kind not in MASK_BUILDERS})
    if bad:
        raise ValueError(f"config.layer_types has layers the stages cannot drive: {', '.join(bad[:4])}"
                         f"{' ...' if len(bad) > 4 else ''}; allowed kinds: {', '.join(MASK_BUILDERS)}")
    return kinds


def _rotary_kinds(rotary_emb: nn.Module, kinds: Sequence[str]) -> tuple[str | None, ...]:
    """The layer types whose ``cos``/``sin`` are carried: each distinct one if ``rotary_emb`` takes a ``layer_type``
    (one rotary per type, as Gemma3's local and global ones), else ``(None,)``: one pair for every layer."""
    if "layer_type" in inspect.signature(rotary_emb.forward).parameters:
        return tuple(sorted(set(kinds)))
    return (None,)


def _softcap(config: Any) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


# -- router auxiliary loss -------------------------------------------------------------------------------
def router_statistics(router_logits: torch.Tensor, mask: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """``[count_e..., prob_e..., rows]`` (float32, ``2 * num_experts + 1``) of one layer's router logits.

    ``router_logits`` is ``(rows, num_experts)``, ``mask`` the flat padding mask of the rows (1 keeps a row).
    ``count_e`` sums the mask over the rows that route to expert ``e`` (top-k of the softmax), ``prob_e`` the
    masked softmax probabilities; they add up over layers and microbatches (see :func:`router_aux_loss`).
    """
    weights = torch.softmax(router_logits, dim=-1)
    _, selected = torch.topk(weights, top_k, dim=-1)
    keep = mask.reshape(-1).to(device=router_logits.device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits.device)
    counts = counts.scatter_add(0, selected.reshape(-1), keep.repeat_interleave(top_k))
    probs = (weights.float() * keep.unsqueeze(-1)).sum(dim=0)
    return torch.cat([counts, probs, keep.sum().reshape(1)])


def router_aux_loss(statistics: torch.Tensor, num_experts: int) -> torch.Tensor:
    """HF's load-balancing loss from summed :func:`router_statistics`: ``E * sum_e (count_e/rows)(prob_e/rows)``.

    Example::

        >>> import torch
        >>> from lightning_memkit.hf.pipeline_stages import router_aux_loss, router_statistics
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
        >>> float(router_aux_loss(router_statistics(logits, torch.ones(2), 3, 1), 3))
        1.3402...
    """
    rows = statistics[2 * num_experts]
    counts, probs = statistics[:num_experts] / rows, statistics[num_experts:2 * num_experts] / rows
    return torch.sum(counts * probs.unsqueeze(0)) * num_experts


def _aux_enabled(model: nn.Module) -> bool:
    """Whether HF adds a router aux loss: ``config.output_router_logits`` on, in a family that has one (its
    modeling module defines ``load_balancing_loss_func``; DeepSeek-V3's does not, and HF adds none)."""
    if not getattr(model.config, "output_router_logits", False):
        return False
    return modeling_function(model, "load_balancing_loss_func") is not None


@dataclass(frozen=True)
class _Router:
    """Where a decoder layer's router logits come from, and the numbers of HF's aux loss."""

    target: type
    index: int
    num_experts: int
    top_k: int
    coef: float

    @property
    def size(self) -> int:
        return 2 * self.num_experts + 1


def _router_spec(model: nn.Module) -> _Router:
    recorder = (getattr(model.model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if not isinstance(target, type) or getattr(recorder, "layer_name", None) or getattr(recorder, "class_name", None):
        raise ValueError("config.output_router_logits=True, but the model records no router logits by module class")
    values = [getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if any(v is None for v in values):
        raise ValueError("config.output_router_logits=True, but the model lacks num_experts, num_experts_per_tok or "
                         "router_aux_loss_coef")
    router = _Router(target, int(getattr(recorder, "index", 0)), int(values[0]), int(values[1]), float(values[2]))
    _check_aux_formula(model, router)
    return router


def _check_aux_formula(model: nn.Module, router: _Router) -> None:
    """Refuse a transformers whose ``load_balancing_loss_func`` is not the sum form :func:`router_aux_loss` uses."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        raise ValueError(f"config.output_router_logits=True, but {type(model).__module__} has no "
                         "load_balancing_loss_func to reproduce")
    if not _aux_formula_matches(fn, router.num_experts, router.top_k):
        raise ValueError(f"{type(model).__module__}.load_balancing_loss_func does not match the per-layer "
                         "router statistics the pipeline carries; its router aux loss cannot be reproduced")


@functools.lru_cache(maxsize=64)
def _aux_formula_matches(fn: Any, num_experts: int, top_k: int) -> bool:
    """Whether ``fn`` (a family's ``load_balancing_loss_func``) is :func:`router_aux_loss` of summed statistics, on
    random logits of two layers, with and without a padding mask (checked once per function and sizes)."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, num_experts, generator=g) for _ in range(2))
    for mask in (torch.tensor([[1, 1, 0], [1, 0, 1]]), None):
        flat = torch.ones(6) if mask is None else mask.reshape(-1)
        ours = router_aux_loss(sum(router_statistics(t, flat, num_experts, top_k) for t in logits), num_experts)
        theirs = fn(logits, num_experts, top_k, mask)
        if not torch.allclose(ours, torch.as_tensor(theirs, dtype=ours.dtype), rtol=1e-5, atol=1e-7):
            return False
    return True


@contextlib.contextmanager
def _captured(routers: Sequence[nn.Module], index: int) -> Iterator[list[torch.Tensor]]:
    """Collect ``output[index]`` of each router call while the block runs (hooks removed on exit)."""
    found: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _m, _i, out: found.append(out[index])) for r in routers]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


# -- the layers ------------------------------------------------------------------------------------------
class Embedding(nn.Module):
    """``embed_tokens(input_ids)`` (its own scale included), the position ids and the rotary ``cos``/``sin``.

    ``rotary_kinds``: ``(None,)`` for one pair shared by every layer, else the layer types whose pairs
    ``rotary_emb(hidden, positions, layer_type=...)`` gives, in this order (computed here, carried on).
    """

    def __init__(self, embed_tokens: nn.Embedding, rotary_emb: nn.Module, statistics_size: int = 0,
                 rotary_kinds: Sequence[str | None] = (None,)):
        super().__init__()
        self.embed_tokens, self.rotary_emb = embed_tokens, rotary_emb
        self.statistics_size = statistics_size
        self.rotary_kinds = tuple(rotary_kinds)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self.embed_tokens(input_ids)
        positions = _positions(hidden)
        out: tuple[torch.Tensor, ...] = (hidden, attention_mask)
        for kind in self.rotary_kinds:
            pair = self.rotary_emb(hidden, positions) if kind is None else self.rotary_emb(hidden, positions,
                                                                                           layer_type=kind)
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
                raise TypeError(f"{type(self.rotary_emb).__name__} returned {type(pair).__name__}; the stages carry "
                                "the (cos, sin) pair a rotary embedding gives its decoder layers")
            out += pair
        if self.statistics_size:
            out += (torch.zeros(self.statistics_size, dtype=torch.float32, device=hidden.device),)
        return out


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """HF's default position ids for a batch without a cache: ``arange(T)`` of shape ``(1, T)``."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


@functools.cache
def _cache_argument(build: Any) -> str:
    """The name of a mask builder's cache argument: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(build).parameters else "past_key_values"


def _attention_mask(config: Any, kind: str, hidden: torch.Tensor, padding: torch.Tensor, positions: torch.Tensor):
    """The mask HF passes to a layer of ``kind``; built once per stage call (the stage scratch keeps it)."""
    scratch = stage_scratch()
    key = ("lightning_memkit.hf.mask", kind, id(padding), tuple(hidden.shape[:2]), hidden.dtype)
    if scratch is not None and key in scratch and scratch[key][0] is padding:
        return scratch[key][1]
    import transformers.masking_utils as masking

    build = getattr(masking, MASK_BUILDERS[kind])
    mask = build(config=config, inputs_embeds=hidden, attention_mask=padding, position_ids=positions,
                 **{_cache_argument(build): None})
    if scratch is not None:
        scratch[key] = (padding, mask)
    return mask


class DecoderLayer(nn.Module):
    """One HF decoder layer, called as the HF model calls it; adds its router statistics when the aux loss is on.

    Takes ``(hidden, padding mask, cos_0, sin_0, ..., cos_{n-1}, sin_{n-1}, [statistics])`` with ``n = pairs``
    rotary pairs carried, and uses pair ``pair`` (its layer type's); returns the same with hidden (and the
    statistics) new.
    """

    def __init__(self, layer: nn.Module, config: Any, kind: str, router: _Router | None = None, pair: int = 0,
                 pairs: int = 1):
        super().__init__()
        self.layer, self.kind = layer, kind
        self.pair, self.pairs = pair, pairs
        self._config, self._router = config, router
        self._routers = [m for m in layer.modules() if isinstance(m, router.target)] if router is not None else []

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions, statistics = rest[:2 * self.pairs], rest[2 * self.pairs:]
        cos, sin = positions[2 * self.pair], positions[2 * self.pair + 1]
        position_ids = _positions(hidden)
        mask = _attention_mask(self._config, self.kind, hidden, attention_mask, position_ids)
        with _captured(self._routers, self._router.index if self._router else 0) as router_logits:
            out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=False,
                             position_embeddings=(cos, sin))
        hidden = out[0] if isinstance(out, tuple) else out
        if self._router is None:
            return (hidden, attention_mask, *positions, *statistics)
        total = statistics[0]
        for logits in router_logits:
            total = total + router_statistics(logits, attention_mask, self._router.num_experts, self._router.top_k)
        return (hidden, attention_mask, *positions, total)


class FinalNorm(nn.Module):
    """The final norm; drops what only the decoder layers need (the padding mask and ``pairs`` rotary pairs)."""

    def __init__(self, norm: nn.Module, pairs: int = 1):
        super().__init__()
        self.norm, self.pairs = norm, pairs

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> Any:
        statistics = rest[2 * self.pairs:]
        hidden = self.norm(hidden)
        return (hidden, *statistics) if statistics else hidden


class Head(nn.Module):
    """``lm_head``, then ``softcap * tanh(logits / softcap)`` when the family caps its final logits
    (``config.final_logit_softcapping``); with ``fused`` it passes the hidden states on and the loss does both
    from ``lm_head.weight`` itself."""

    def __init__(self, lm_head: nn.Linear, fused: bool = False, softcap: float | None = None):
        super().__init__()
        self.lm_head, self.fused, self.softcap = lm_head, fused, softcap

    def forward(self, hidden: torch.Tensor, *statistics: torch.Tensor) -> Any:
        if self.fused:
            out = hidden
        else:
            out = self.lm_head(hidden)
            if self.softcap is not None:  # as HF: in the logits' dtype, before the loss upcasts them
                out = torch.tanh(out / self.softcap) * self.softcap
        return (out, *statistics) if statistics else out


# -- batch and loss --------------------------------------------------------------------------------------
def causal_lm_inputs(batch: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``((input_ids, attention_mask), labels)`` of an HF batch dict; the mask is int64 (ones when absent)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"a Hugging Face pipeline batch must be a dict with input_ids, labels and optionally "
                        f"attention_mask, got {type(batch).__name__}")
    keys = sorted(k for k, v in batch.items() if v is not None)
    extra = [k for k in keys if k not in _BATCH_KEYS]
    missing = [k for k in _BATCH_KEYS[:2] if k not in keys]
    if extra or missing:
        raise ValueError(f"a Hugging Face pipeline batch holds input_ids, labels and optionally attention_mask; got "
                         f"{keys}" + (f" (missing {missing})" if missing else "") + (f" (unsupported {extra})"
                                                                                   if extra else ""))
    ids = batch["input_ids"]
    for key in keys:
        t = batch[key]
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.is_floating_point() or t.is_complex():
            raise TypeError(f"batch[{key!r}] must be a 2-D integer tensor (batch, time), got "
                            f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
        if t.shape != ids.shape:
            raise ValueError(f"batch[{key!r}] has shape {tuple(t.shape)}, input_ids {tuple(ids.shape)}")
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.int64) if mask is None else mask.to(torch.int64)
    return (ids, mask), batch["labels"]


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """HF's shift: the label of position ``i`` is token ``i + 1``; the last position is ignored."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class CausalLMLoss(BatchLoss):
    """HF's causal-LM loss over the whole batch (plus the router aux loss), one microbatch at a time.

    ``begin(labels, microbatches)`` counts the valid tokens of the batch; each microbatch returns
    ``microbatches * token_loss_sum / valid_tokens`` plus its aux term: with the batch's expert counts and rows
    from :meth:`observe` (``router_aux="exact"``), ``coef * microbatches * E * sum_e (count_e / rows) *
    (its prob_e / rows)``, else ``coef *`` its own aux loss. :meth:`end` returns HF's value for the batch:
    ``token_loss_sum / valid_tokens + coef * aux(summed statistics)``. ``softcap`` (the family's final-logit
    softcap) is applied by the fused loss; unfused, the :class:`Head` has applied it to the logits.
    """

    def __init__(self, lm_head: nn.Linear, *, fused: bool = False, router: _Router | None = None,
                 router_aux: str = "exact", softcap: float | None = None):
        self.lm_head, self.fused, self.router, self.softcap = lm_head, fused, router, softcap
        self.observes_forward = router is not None and router_aux == "exact"
        self._microbatches: int | None = None
        self._valid: torch.Tensor | None = None
        self._observed: torch.Tensor | None = None
        self._records: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def begin(self, target: torch.Tensor, microbatches: int) -> None:
        self._microbatches = microbatches
        self._valid = (_shifted(target) != IGNORE_INDEX).sum()
        self._observed = None
        self._records = []

    def observe(self, output: Any, target: torch.Tensor) -> None:
        """Add one microbatch's router statistics from the forward pass without gradients."""
        if self.router is None:
            return
        statistics = output[1].detach()
        self._observed = statistics if self._observed is None else self._observed + statistics

    def _aux_term(self, statistics: torch.Tensor) -> torch.Tensor:
        e = self.router.num_experts
        if self._observed is None:  # this microbatch's own aux loss
            return router_aux_loss(statistics, e)
        counts, rows = self._observed[:e], self._observed[2 * e]  # the whole batch's (no gradient)
        return self._microbatches * e * torch.sum((counts / rows) * (statistics[e:2 * e] / rows))

    def _token_loss_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift = _shifted(labels).reshape(-1).to(x.device)
        x = x.reshape(-1, x.shape[-1])
        if self.fused:
            head = self.lm_head
            return linear_cross_entropy(x, head.weight, shift, bias=head.bias, ignore_index=IGNORE_INDEX,
                                        softcap=self.softcap, reduction="sum")
        return cross_entropy(x.float(), shift, ignore_index=IGNORE_INDEX, reduction="sum")

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if self._valid is None:
            raise RuntimeError("CausalLMLoss.begin(labels, microbatches) must run before the microbatches")
        parts = output if isinstance(output, tuple) else (output,)
        token_sum = self._token_loss_sum(parts[0], target)
        term = token_sum * (self._microbatches / self._valid.to(token_sum.device))
        statistics = parts[1] if self.router is not None else None
        if statistics is not None:
            term = term + self.router.coef * self._aux_term(statistics)
        self._records.append((token_sum.detach(), None if statistics is None else statistics.detach()))
        return term

    def end(self, terms: Sequence[torch.Tensor]) -> torch.Tensor:
        records = self._records[-len(terms):]
        value = torch.stack([r[0] for r in records]).sum() / self._valid.to(records[0][0].device)
        if self.router is not None:
            total = torch.stack([r[1] for r in records]).sum(dim=0)
            value = value + self.router.coef * router_aux_loss(total, self.router.num_experts)
        return value


@dataclass(frozen=True)
class CausalLMStages:
    """The pipeline layers of an HF causal LM, with its :class:`CausalLMLoss` and batch split."""

    layers: nn.ModuleList
    loss: CausalLMLoss

    @staticmethod
    def inputs(batch: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``((input_ids, attention_mask), labels)``: see :func:`causal_lm_inputs`."""
        return causal_lm_inputs(batch)


def causal_lm_stages(model: nn.Module, *, fused_loss: bool = False, router_aux: str = "exact",
                     verify: bool = True) -> CausalLMStages:
    """Split a transformers causal LM into pipeline layers that share its modules (see the module docstring).

    Args:
        model: a decoder-only ``PreTrainedModel`` with the ``.model.*``/``.lm_head`` layout (any family).
        fused_loss: the loss runs through :func:`~lightning_memkit.ops.linear_cross_entropy` (no logits).
        router_aux: ``"exact"`` (HF's router aux gradient; one more forward pass per training step) or
            ``"microbatch"`` (each microbatch's own aux loss); only matters with ``output_router_logits``.
        verify: run the model and the stages once on a probe batch (2 x 8 tokens, longer than a sliding window
            or attention chunk below 62 tokens; one row padded; evaluation mode, no gradients; skipped for a model
            on ``meta`` or fake tensors) and refuse logits or a loss that differ from the model's own.

    Raises ``TypeError`` for a non-transformers model and ``ValueError`` naming what keeps it from being split;
    the model is not changed either way.
    """
    check_bool(fused_loss, "fused_loss", owner="causal_lm_stages")
    check_choice(router_aux, "router_aux", ROUTER_AUX_MODES, owner="causal_lm_stages")
    check_bool(verify, "verify", owner="causal_lm_stages")
    base_class = _pretrained_model_class()
    if base_class is None or not isinstance(model, base_class):
        raise TypeError(f"causal_lm_stages(model=...): must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__}")
    problems = causal_lm_problems(model)
    if problems:
        raise ValueError(f"causal_lm_stages(model={type(model).__name__}): cannot be split: {'; '.join(problems)}")
    layers, loss = _build(model, fused_loss, router_aux)
    if verify:
        problem = _probe_problem(model)
        if problem is not None:
            raise ValueError(f"causal_lm_stages(model={type(model).__name__}): cannot be split: {problem}")
    return CausalLMStages(nn.ModuleList(layers), loss)


def _build(model: nn.Module, fused: bool, router_aux: str) -> tuple[list[nn.Module], CausalLMLoss]:
    config, base = model.config, model.model
    router = _router_spec(model) if _aux_enabled(model) else None
    kinds = _layer_kinds(config, len(base.layers))
    rotary = _rotary_kinds(base.rotary_emb, kinds)
    pair = (lambda kind: 0) if rotary == (None,) else rotary.index
    softcap = _softcap(config)
    layers = [
        Embedding(base.embed_tokens, base.rotary_emb, router.size if router else 0, rotary),
        *(DecoderLayer(layer, config, kind, router, pair(kind), len(rotary))
          for layer, kind in zip(base.layers, kinds)),
        FinalNorm(base.norm, len(rotary)),
        Head(model.lm_head, fused=fused, softcap=softcap),
    ]
    loss = CausalLMLoss(model.lm_head, fused=fused, router=router, router_aux=router_aux, softcap=softcap)
    return layers, loss


# -- the probe: the stages reproduce the model's own forward ------------------------------------------------
def _runnable(model: nn.Module) -> bool:
    """Whether the model has real weights (not ``meta``, not fake tensors) to run the probe on."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(t.is_meta or is_fake(t) for t in itertools.chain(model.parameters(), model.buffers()))


def _probe_length(config: Any) -> int:
    """8 tokens, or past the sliding window or attention chunk where one is shorter than 62 (then the probe sees
    the difference between the kinds of mask; longer windows would make it costly)."""
    windows = [w for w in (getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None))
               if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return max([_PROBE_TOKENS, *(w + 2 for w in windows if w + 2 <= _PROBE_MAX_TOKENS)])


def _probe_batch(vocab: int, length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """2 x ``length`` tokens spread over the vocabulary; the second row left-padded by 3 (mask 0, labels -100)."""
    ids = (torch.arange(2 * length, device=device) * 7919 + 13) % vocab
    ids = ids.reshape(2, length)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    ours, theirs = ours.detach().float(), theirs.detach().float()
    if ours.shape != theirs.shape:
        return False
    tol = 1e-4 if theirs.dtype == torch.float32 else 2e-2
    scale = max(1.0, float(theirs.abs().nan_to_num(0.0).max())) if theirs.numel() else 1.0
    return torch.allclose(ours, theirs, rtol=tol, atol=tol * scale, equal_nan=True)


def _probe_problem(model: nn.Module) -> str | None:
    """``None`` if the stages give the model's own logits and loss on :func:`_probe_batch`, else what differs.

    Runs in evaluation mode without gradients (each module's mode is restored); skipped (``None``) for a model
    without real weights. A separate unfused set of layers is used, so the fused head is checked through the
    same modules.
    """
    if not _runnable(model):
        return None
    layers, loss = _build(model, False, "microbatch")
    embed = model.model.embed_tokens.weight
    batch = _probe_batch(int(embed.shape[0]), _probe_length(model.config), embed.device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            try:
                reference = model(**batch, use_cache=False)
            except Exception as err:  # noqa: BLE001 - reported as the reason the model is refused
                return f"its own forward failed on the probe batch ({type(err).__name__}: {err})"
            try:
                out = LayerChain(*layers)(batch["input_ids"], batch["attention_mask"])
                ours = loss.whole(out, batch["labels"])
            except Exception as err:  # noqa: BLE001
                return (f"the stages failed on a probe batch where {type(model).__name__}.forward runs "
                        f"({type(err).__name__}: {err})")
    finally:
        for module, mode in modes:
            module.training = mode
    logits = out[0] if isinstance(out, tuple) else out
    what = [name for name, a, b in (("logits", logits, reference.logits), ("loss", ours, reference.loss))
            if not _close(a, b)]
    if what:
        diff = (logits.float() - reference.logits.float()).abs().max() if logits.shape == reference.logits.shape \
            else float("nan")
        return (f"the stages do not reproduce {type(model).__name__}.forward on a probe batch ({' and '.join(what)} "
                f"differ; largest logit difference {float(diff):.3g}): its *Model.forward or head does more than "
                "embed_tokens, the decoder layers, norm, lm_head and final_logit_softcapping")
    return None
