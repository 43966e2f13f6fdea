"""Adapters that travel: write a model's LoRA adapters in peft's format, with what rebuilds the base as trained.

``export_adapters(module, directory)`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` (what
``PeftModel.from_pretrained`` reads) for peft's adapters or for ``NoSaveBitsandbytesPrecision``'s own
(``lora_rank > 0``: each layer's ``A``/``B`` become peft's ``lora_A``/``lora_B``, the same scaling), and
``memkit_base.json``: the base's name or path, the dtype to load it in, and the ``BitsAndBytesConfig``
arguments of its quantization (type, double quantization, compute dtype; block size 64, transformers' own).
Loading the base that way and the adapters with peft gives the trained model (``docs/finetune.md``).
:class:`ExportAdapters` does it at the end of ``fit``.

Example::

    >>> import json, tempfile
    >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
    >>> from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
    >>> model = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4).convert_module(tiny_hf_causal_lm("llama"))
    >>> out = export_adapters(model, tempfile.mkdtemp(), base="my/llama", base_dtype="float32")
    >>> json.loads((out / "memkit_base.json").read_text())["bitsandbytes_config"]["bnb_4bit_quant_type"]
    'nf4'
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_memkit.common.class_paths import base_named
from lightning_memkit.hf.qlora import QLoRAExperts, dequantized_experts, expert_projections, hf_models
from lightning_memkit.ops.lora import ExpertLoRAAdapter, LoRAAdapter

__all__ = ["BASE_FILE", "ExportAdapters", "check_exportable", "export_adapters", "export_merged"]

BASE_FILE = "memkit_base.json"
_OWNER = "export_adapters"
_CALLBACK = "ExportAdapters"


def export_adapters(module: nn.Module, directory: str | Path, *, base: str | None = None,
                    base_dtype: str | torch.dtype | None = None) -> Path | None:
    """Write the adapters of the transformers model inside ``module`` to ``directory`` (see the module).

    Args:
        module: a LightningModule (or any module) holding one transformers causal LM, peft-wrapped or converted by
            ``NoSaveBitsandbytesPrecision`` with ``lora_rank > 0``.
        directory: created if missing.
        base: the base's name or path (default: the model config's ``_name_or_path``).
        base_dtype: the dtype to load the base in (default: for a quantized base, the dtype its weights were
            quantized from, as loaded; else ``module.hparams["dtype"]``, as
            :class:`~lightning_memkit.finetune.PretrainedCausalLM` records it, else the dtype of the model's input
            embedding).

    A module sharded by FSDP2 (``strategy="memkit_fsdp2"``: its parameters ``DTensor``): every rank calls it, its
    trainable parameters are gathered whole (a collective; nothing frozen is gathered) and global rank 0 writes the
    same files as one device would; the other ranks return ``None``.

    Returns the directory. Raises ``ValueError`` when the model has no adapters, or adapters peft cannot hold
    (the experts' adapters of a quantized MoE model).
    """
    model, quantization, peft_model, own = _checked(module)  # every refusal before anything is written
    whole = _whole_trainables(module)
    if whole and torch.distributed.get_rank() != 0:
        return None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if peft_model is not None:
        base = base or peft_model.peft_config["default"].base_model_name_or_path
        state = {name: whole[id(p)] for name, p in peft_model.named_parameters() if id(p) in whole}
        peft_model.save_pretrained(str(out), state_dict=state or None)
    else:
        base = base or getattr(model.config, "_name_or_path", None)
        _save_own(*own, out, base, whole)
    dtype = _base_dtype(module, model, base_dtype)
    (out / BASE_FILE).write_text(json.dumps({
        "base_model_name_or_path": base, "dtype": dtype, "bitsandbytes_config": quantization,
    }, indent=2) + "\n")
    return out


def _whole_trainables(module: nn.Module) -> dict[int, torch.Tensor]:
    """The trainable parameters of ``module`` sharded by FSDP2 (``DTensor``), each gathered whole (by ``id``), in
    the module's order on every rank; ``{}`` when none is sharded (no collective)."""
    return {id(p): p.detach().full_tensor() for p in module.parameters()
            if p.requires_grad and hasattr(p, "full_tensor")}


def _the_model(module: nn.Module, owner: str = _OWNER) -> nn.Module:
    models = hf_models(module)
    if len(models) != 1:
        raise ValueError(f"{owner}: {type(module).__name__} holds {len(models)} transformers models; one is needed")
    return models[0][1]


def _peft_model(module: nn.Module) -> Any:
    """The peft model inside ``module``, or None."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return next((m for m in module.modules() if isinstance(m, PeftModel)), None)


def check_exportable(module: nn.Module) -> None:
    """Raise the error :func:`export_adapters` would raise for ``module``, before anything is written
    (``ExportAdapters`` checks at the start of fit, not after the training)."""
    _checked(module)


def _checked(module: nn.Module, owner: str = _OWNER) -> tuple[nn.Module, dict[str, Any] | None, Any, Any]:
    """``(model, BitsAndBytesConfig arguments, peft model or None, the plugin's adapters or None)``, each refusal
    of :func:`export_adapters` raised here (its message starting with ``owner``)."""
    model = _the_model(module, owner)
    quantization = _quantization(model, owner)
    peft_model = _peft_model(module)
    return model, quantization, peft_model, None if peft_model is not None else _own_adapters(model, owner)


def _check_before_conversion(module: nn.Module, precision: Any, owner: str) -> None:
    """Raise the error :func:`export_adapters` will raise once ``module`` is trained, from the module as it is before
    the strategy converts it (``precision``, the Trainer's precision plugin, converts it at the strategy's setup):
    a ``NoSaveBitsandbytesPrecision`` with ``lora_rank > 0`` that has not converted ``module`` yet adds adapters to
    its Linear layers (and to its MoE experts, which peft cannot hold: refused). A module that holds no
    transformers model yet and builds it in ``configure_model`` or ``setup`` is left to :func:`check_exportable`."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_memkit.hf.qlora import expert_modules
    from lightning_memkit.plugins.nosave_bitsandbytes import NoSaveBitsandbytesPrecision

    if not hf_models(module) and isinstance(module, pl.LightningModule) and any(
            is_overridden(hook, module) for hook in ("configure_model", "setup")):
        return
    model = _the_model(module, owner)
    if _peft_model(module) is not None:
        return
    plugin = precision if isinstance(precision, NoSaveBitsandbytesPrecision) else None
    if plugin is None or plugin.lora_rank == 0 or module in plugin._converted:
        _own_adapters(model, owner)  # adapters already there, or none to come
        return
    adapted = [n for n, _ in expert_modules(model) if not any(n.startswith(s) for s in plugin.ignore_modules)]
    if adapted:
        raise ValueError(f"{owner}: NoSaveBitsandbytesPrecision(lora_rank={plugin.lora_rank}) will put adapters on "
                         f"the MoE experts ({', '.join(map(repr, adapted[:3]))}{', ...' if len(adapted) > 3 else ''})"
                         ", which have no peft format; allowed: a peft LoraConfig on Linear layers with lora_rank=0, "
                         "or the experts in ignore_modules")


def _own_adapters(model: nn.Module, owner: str = _OWNER) -> tuple[dict[str, LoRAAdapter], tuple[int, float, float]]:
    """The plugin's adapters by layer name, and their one ``(rank, alpha, dropout)``."""
    if any(isinstance(m, ExpertLoRAAdapter) for m in model.modules()):
        raise ValueError(f"{owner}: the experts' adapters of a quantized MoE model have no peft format; only "
                         "Linear layers' adapters can be exported")
    layers = {name: m.lora for name, m in model.named_modules() if isinstance(getattr(m, "lora", None), LoRAAdapter)}
    if not layers:
        raise ValueError(f"{owner}: the model has no adapters (train with NoSaveBitsandbytesPrecision(lora_rank=...) "
                         "or a peft LoraConfig; a full fine-tune: memkit export --merged"
                         + (f", without {_CALLBACK} in the callbacks)" if owner == _CALLBACK else ")"))
    shapes = {(a.rank, a.alpha, _dropout(a)) for a in layers.values()}
    if len(shapes) != 1:
        raise ValueError(f"{owner}: the adapters differ in rank, alpha or dropout ({sorted(shapes)}); peft's "
                         "LoraConfig holds one of each")
    return layers, shapes.pop()


def _save_own(layers: dict[str, LoRAAdapter], shape: tuple[int, float, float], out: Path, base: str | None,
              whole: dict[int, torch.Tensor]) -> None:
    """``NoSaveBitsandbytesPrecision``'s adapters (:func:`_own_adapters`) as a peft LoRA adapter (the same names,
    shapes and scaling); a sharded one's values from ``whole`` (:func:`_whole_trainables`)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    rank, alpha, dropout = shape
    LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(layers), task_type="CAUSAL_LM",
               base_model_name_or_path=base).save_pretrained(str(out))
    tensors = {}
    for name, adapter in layers.items():
        for key, p in (("lora_A", adapter.A), ("lora_B", adapter.B)):
            tensors[f"base_model.model.{name}.{key}.weight"] = whole.get(id(p), p).detach().cpu().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))


def _dropout(adapter: LoRAAdapter) -> float:
    return float(getattr(adapter.dropout, "p", 0.0))


def _quantization(model: nn.Module, owner: str = _OWNER) -> dict[str, Any] | None:
    """``BitsAndBytesConfig`` arguments for the model's quantized Linear layers, or None when none is."""
    from lightning_memkit.plugins.nosave_linear import NoSaveLinearMixin

    layer = next((m for m in model.modules() if isinstance(m, NoSaveLinearMixin) and m.is_quantized), None)
    if layer is None:
        return None
    meta = layer.packed_meta  # the layer's own record (its weight may be FSDP2's parameter)
    if meta is None:
        return {"load_in_8bit": True}
    if meta.blocksize != 64:
        raise ValueError(f"{owner}: the base was quantized in blocks of {meta.blocksize}; transformers' "
                         "BitsAndBytesConfig quantizes in blocks of 64")
    return {"load_in_4bit": True, "bnb_4bit_quant_type": meta.quant_type,
            "bnb_4bit_use_double_quant": meta.nested_blocksize is not None,
            "bnb_4bit_compute_dtype": str(layer.compute_dtype).removeprefix("torch.")}


def _base_dtype(module: nn.Module, model: nn.Module, given: str | torch.dtype | None) -> str:
    """The dtype to load the base in: ``given``; else, for a quantized base, the dtype its weights were quantized
    from (the plugin quantizes them as loaded, as ``BitsAndBytesConfig`` does); else the one the module loaded it in
    (``hparams["dtype"]``, as :class:`~lightning_memkit.finetune.PretrainedCausalLM` records it); else that of the
    model's input embedding."""
    if given is None:
        given = next((m.source_dtype for m in model.modules() if getattr(m, "source_dtype", None) is not None), None)
    if given is None:
        hparams = getattr(module, "hparams", None)
        given = hparams.get("dtype") if hasattr(hparams, "get") else None
    if given is None:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        given = embedding.weight.dtype if embedding is not None else next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(given).removeprefix("torch.")


def export_merged(module: nn.Module, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the trained model as a plain transformers checkpoint in ``dtype``: every quantized weight dequantized and
    its adapter folded in (``W + scaling * B @ A``, formed in float32, rounded once), every other weight as trained;
    it loads with ``AutoModelForCausalLM.from_pretrained`` alone (no bitsandbytes, no peft). Its numbers are not the
    trained model's exactly (the dense weights replace dequantize-then-multiply, one rounding replaces the adapter's
    own path): ``docs/finetune.md`` gives the measured difference.

    Example::

        >>> import tempfile
        >>> from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
        >>> from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
        >>> plugin = NoSaveBitsandbytesPrecision("nf4", "float32", lora_rank=4)
        >>> out = export_merged(plugin.convert_module(tiny_hf_causal_lm("llama")), tempfile.mkdtemp())
        >>> sorted(p.name for p in out.iterdir())
        ['config.json', 'generation_config.json', 'model.safetensors']
    """
    from transformers import AutoModelForCausalLM

    model = _the_model(module)
    if any(isinstance(m, ExpertLoRAAdapter) for m in model.modules()):
        raise ValueError("export_merged: the experts of a quantized MoE model are not merged yet")
    config = copy.deepcopy(model.config)
    config.quantization_config = None
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: _merged(model, name, tensor).to(dtype) for name, tensor in dense.state_dict().items()}
    dense.load_state_dict(state)
    out = Path(directory)
    dense.save_pretrained(str(out))
    return out


def _merged(model: nn.Module, name: str, like: torch.Tensor) -> torch.Tensor:
    """The dense value of ``name`` (a parameter or buffer path of the plain model) in the trained ``model``."""
    from lightning_memkit.ops.nosave_matmul import dequantize_weight
    from lightning_memkit.plugins.nosave_linear import NoSaveLinearMixin

    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    base = getattr(owner, "base_layer", owner)  # a peft LoRA layer wraps the Linear it adapts
    if attr == "weight" and isinstance(base, NoSaveLinearMixin) and base.is_quantized:
        weight = dequantize_weight(base, torch.float32)
    elif isinstance(owner, QLoRAExperts) and attr in expert_projections(owner):  # quantized, without adapters
        weight = dequantized_experts(owner)[attr]  # (adapters on experts are refused before the merge)
    else:
        weight = getattr(base, attr).detach().float()
    if attr == "weight":
        for a, b, scaling in _adapters(owner):
            weight = weight + scaling * (b.detach().float() @ a.detach().float())
    if weight.shape != like.shape:
        raise ValueError(f"export_merged: {name} has shape {tuple(weight.shape)} in the trained model, "
                         f"{tuple(like.shape)} in its config's")
    return weight


def _adapters(owner: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(A, B, scaling)`` of the adapters on ``owner``: the plugin's ``lora``, or peft's active ones."""
    own = getattr(owner, "lora", None)
    if isinstance(own, LoRAAdapter):
        return [(own.A, own.B, own.scaling)]
    if hasattr(owner, "lora_A") and hasattr(owner, "base_layer"):
        active = [k for k in owner.active_adapters if k in owner.lora_A]
        if any(getattr(owner, "use_dora", {}).get(k) for k in active):
            raise ValueError("export_merged: DoRA adapters (use_dora=True) are not merged: their magnitude vector "
                             "rescales the merged weight; export them with export_adapters")
        return [(owner.lora_A[k].weight, owner.lora_B[k].weight, float(owner.scaling[k])) for k in active]
    return []


_SHARDED = ("FSDPStrategy", "DeepSpeedStrategy")  # strategies whose ranks hold flat shards, not DTensors


class ExportAdapters(Callback):
    """Export the adapters (:func:`export_adapters`) at the end of ``fit``, from global rank 0 (under
    ``memkit_fsdp2`` or another FSDP2 ``ModelParallelStrategy``, the adapters gathered from every rank first).

    A model that will have nothing to export (no adapters, none that the precision plugin adds, or the experts'
    adapters of a quantized MoE model) is refused with one line by :meth:`preflight`, before any training:
    ``memkit fit`` runs it before the fit starts; a ``Trainer`` at this callback's ``setup``, or at
    ``MemoryBudget``'s before it plans, whatever order the callbacks are listed in. ``on_fit_start`` checks the
    converted model again.

    Args:
        dirpath: where to write them (default: ``<trainer.default_root_dir>/adapters``).

    Example (LightningCLI YAML)::

        trainer:
          callbacks:
            - class_path: lightning_memkit.finetune.ExportAdapters
              init_args: {dirpath: runs/my_qlora/adapters}
    """

    def __init__(self, dirpath: str | None = None) -> None:
        if dirpath is not None and (not isinstance(dirpath, str) or not dirpath):
            raise ValueError(f"ExportAdapters(dirpath={dirpath!r}): give a directory path or None")
        self.dirpath = dirpath
        self.written: Path | None = None

    def preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raise ``ValueError`` (one line, naming this callback and what is allowed) when the fit would end with
        nothing to export: checked on the module as built, before the precision plugin converts it (the plugin's
        ``lora_rank`` adapters are counted). Cheap, and safe to call more than once."""
        sharded = base_named(trainer.strategy, _SHARDED)
        if sharded is not None:
            raise ValueError(f"{_CALLBACK}: under {type(trainer.strategy).__name__} (a {sharded}) each rank holds a "
                             "flat shard of the adapters, which is not exported; allowed: strategy='memkit_fsdp2' "
                             "(FSDP2), DDP or one device")
        _check_before_conversion(pl_module, trainer.precision_plugin, _CALLBACK)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.preflight(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _checked(pl_module, _CALLBACK)  # the model is converted by now: refuse before training, not after it

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_memkit.sharding import is_sharded

        if not trainer.is_global_zero and not is_sharded(pl_module):  # sharded: every rank gathers
            return
        directory = self.dirpath or str(Path(trainer.default_root_dir) / "adapters")
        written = export_adapters(pl_module, directory)
        if trainer.is_global_zero:
            self.written = written
            print(f"ExportAdapters: adapters written to {written} (load: see {written / BASE_FILE})")
