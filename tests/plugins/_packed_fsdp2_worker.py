"""One rank of the packed-layers-under-FSDP2 tests. Run by tests/plugins/test_packed_fsdp2.py.

    LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _packed_fsdp2_worker.py OUT

A tiny transformers Llama, converted by ``NoSaveBitsandbytesPrecision`` (nf4, nf4-dq, int8 with its own adapters;
nf4 under peft's), ``fully_shard`` on each decoder layer and the root, on two gloo ranks. Per case, against the same
model on one process (each rank builds it): the packed bytes and quant state gathered (one weight holds bytes that
are NaN read as bf16), the losses of three AdamW steps of the adapters (each rank half of the global batch) and a
``torch.distributed.checkpoint`` save and load into a fresh sharded model. Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_memkit.demo.hf_models import tiny_hf_config
from lightning_memkit.hf.layers import decoder_layers
from lightning_memkit.plugins import NoSaveBitsandbytesPrecision
from lightning_memkit.plugins.nosave_bitsandbytes import packed_modes
from lightning_memkit.plugins.packed_state import STATE_PARAMETERS

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
CASES = [("nf4", "own"), ("nf4-dq", "own"), ("int8", "own"), ("nf4", "peft")]
STEPS, LR, BATCH, SEQ, VOCAB = 3, 1e-2, 4, 16, 1000
NAN_BF16 = torch.tensor([0xFF, 0x7F, 0x81, 0xFF, 0xC0, 0x7F, 0x81, 0x7F], dtype=torch.uint8)  # NaN bf16 pairs
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(mode: str, adapters: str, seed: int = 0) -> nn.Module:
    """The converted model (same on every rank for one ``seed``), adapters away from zero, NaN-pattern bytes in the
    first packed weight."""
    torch.manual_seed(seed)
    config = tiny_hf_config("llama", hidden_size=64, num_layers=2, vocab_size=VOCAB)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dtype = torch.float16 if mode == "int8" else torch.float32
    if adapters == "none":
        model = NoSaveBitsandbytesPrecision(mode, dtype).convert_module(model)
    elif adapters == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
        model = NoSaveBitsandbytesPrecision(mode, dtype).convert_module(model)
    else:
        model = NoSaveBitsandbytesPrecision(mode, dtype, lora_rank=8).convert_module(model)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora.B" in name or "lora_B" in name):
                p.normal_(0, 0.02, generator=generator)
        w = next(p for n, p in model.named_parameters() if n.endswith("q_proj.weight") or
                 n.endswith("q_proj.base_layer.weight"))
        n = w.numel() * w.element_size() // 8 * 8
        w.view(torch.uint8).view(-1)[:n] = NAN_BF16.repeat(n // 8)
    return model


def packed_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bytes of every packed weight and quant-state parameter (the integer ones), whole (gathered from FSDP2's
    shards)."""
    out = {}
    for name, p in model.named_parameters():
        if p.dtype in (torch.uint8, torch.int8):
            t = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = t.detach().reshape(-1).view(torch.uint8).clone()
    return out


def shard(model: nn.Module, **kwargs) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for _, layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def train(model: nn.Module, ids: torch.Tensor, world: int) -> list[float]:
    """Three AdamW steps of the trainable parameters; the loss of each, averaged over the ranks when sharded."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def gathered_in_forward(model: nn.Module) -> dict[str, torch.Tensor]:
    """The packed bytes as forward sees them: every unit unsharded (FSDP2's unsharded parameters)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        return {n: p.detach().reshape(-1).view(torch.uint8).clone() for n, p in model.named_parameters()
                if p.dtype in (torch.uint8, torch.int8)}
    finally:
        for unit in units:
            unit.reshard()


def run_case(mode: str, adapters: str, rank: int, world: int, out: Path) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    single = build(mode, adapters)
    keys = list(single.state_dict())
    before = packed_bytes(single)
    reference = train(copy.deepcopy(single), ids, 1)
    model = shard(build(mode, adapters))
    sharded = any(isinstance(p, DTensor) and p.to_local().numel() < p.numel()
                  for n, p in model.named_parameters() if n.rpartition(".")[2] in STATE_PARAMETERS)
    result = {"sharded_quant_state": sharded,
              "gathered_equal": _equal(packed_bytes(model), before),
              "unsharded_equal": _equal(gathered_in_forward(model), before)}
    half = BATCH // world
    losses = train(model, ids[rank * half:(rank + 1) * half], world)
    result["losses"], result["reference"] = losses, reference
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, reference))
    result["packed_unchanged"] = _equal(packed_bytes(model), before)
    saved = get_model_state_dict(model)
    result["keys_as_one_process"] = list(saved) == keys
    result["packed_modes"] = sorted(packed_modes(saved))
    path = out / f"dcp_{mode}_{adapters}"
    dcp.save(saved, checkpoint_id=str(path))
    fresh = shard(build(mode, adapters, seed=7))  # other weights, other quant state
    result["fresh_differed"] = not _equal(packed_bytes(fresh), before)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(fresh, state)
    result["loaded_equal"] = _equal(packed_bytes(fresh), packed_bytes(model))
    full, expected = get_model_state_dict(fresh, options=_full()), get_model_state_dict(model, options=_full())
    result["state_dict_mismatches"] = sorted(k for k in expected.keys() | full.keys()
                                             if k not in full or k not in expected or not _same(full[k], expected[k]))
    return result


def mixed_precision() -> dict:
    """nf4 under ``MixedPrecisionPolicy(param_dtype=bfloat16)``: the byte parameters are gathered uncast (no
    adapters: the plugin's own compute in float32); the plugin's own adapters, gathered in bf16, train (widened to
    float32 in their update, their gradients float32 shards as the parameters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    before = packed_bytes(build("nf4", "none"))
    model = shard(build("nf4", "none"), mp_policy=policy)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    adapted = shard(build("nf4", "own"), mp_policy=policy)
    trained = adapted(input_ids=ids, labels=ids).loss
    trained.backward()
    grads = [p.grad for p in adapted.parameters() if p.requires_grad]
    return {"bytes_equal": _equal(gathered_in_forward(model), before), "finite": bool(torch.isfinite(loss)),
            "adapters_train": bool(torch.isfinite(trained)) and bool(grads)
            and all(g is not None and g.dtype == torch.float32 and bool(torch.isfinite(g.full_tensor()).all())
                    for g in grads)}


def _full():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        results = {f"{mode}-{adapters}": run_case(mode, adapters, rank, world, out) for mode, adapters in CASES}
        results["mixed_precision"] = mixed_precision()
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
