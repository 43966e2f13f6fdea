"""QLoRA training steps on tiny Hugging Face MoE models: memkit's plugin against peft, bf16 and bitsandbytes.

Models: random Qwen3-MoE and GPT-OSS built from their configs (hidden 512, 4 decoder layers, 8 experts, 2 per
token, expert width 1024, vocabulary 256: the experts hold most of the weights); ``--quick``: hidden 128, 2
layers, expert width 256. Every implementation starts from the same bfloat16 weights and puts rank-8 LoRA (alpha 16, no
dropout) on ``q/k/v/o_proj`` and, one adapter pair per expert, on the experts' ``gate_up_proj`` and
``down_proj``:

- ``memkit``: ``NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=8).convert_module(model)`` (the
  attention projections and the 3-D expert weights in nf4, the rest frozen in bfloat16);
- ``peft-bf16`` (baseline): no quantization; the bfloat16 model frozen, peft ``LoraConfig(target_modules=
  [q/k/v/o_proj], target_parameters=[experts' gate_up_proj, down_proj])``;
- ``peft-bnb-qlora``: the attention projections replaced by ``bitsandbytes.nn.Linear4bit`` (nf4, bfloat16
  compute), quantized in memory (``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` would need a
  checkpoint; bitsandbytes quantizes ``nn.Linear`` only, so the 3-D experts stay unquantized), then
  ``peft.prepare_model_for_kbit_training(use_gradient_checkpointing=False)`` (no recomputation, as in the
  other two; it casts the unquantized parameters to float32, as it does for every model) and the same
  ``LoraConfig``.

Per implementation, on one fixed batch of byte text (4 x 64 tokens) with AdamW (lr 1e-2) over the adapters:
``resident_bytes`` (distinct storage of parameters, buffers, bitsandbytes quant states and AdamW state after
a warm-up step), ``step_peak_bytes`` (``LivePeak`` over forward + backward + optimizer step + ``zero_grad``:
new storage only), their sum, the time of a step relative to the baseline (steps interleaved across the
implementations; medians), and the loss at the first and the last step.

    python -m benchmarks.run --only hf_qlora [--quick]
"""

from __future__ import annotations

import statistics
import traceback

import torch
from torch import nn

from benchmarks.common import mib, record, time_once
from lightning_memkit.demo import ByteTextDataModule
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
from lightning_memkit.measure.storage import tensors_in, unique_storage_bytes
from lightning_memkit.memory import LivePeak

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine
BASELINE = "peft-bf16"
PEER = "peft-bnb-qlora"
IMPLS = ("memkit", BASELINE, PEER)
RANK, ALPHA, LR = 8, 16, 1e-2
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model(family: str, quick: bool) -> nn.Module:
    hidden, layers = (128, 2) if quick else (512, 4)
    width = {"moe_intermediate_size": 2 * hidden} if family == "qwen3_moe" else {}  # GPT-OSS: 2 * hidden already
    return tiny_hf_causal_lm(family, seed=0, dtype=torch.bfloat16, hidden_size=hidden, num_layers=layers,
                             num_experts=8, **width)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION,
                      target_parameters=EXPERTS)


def _memkit(model: nn.Module) -> nn.Module:
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    return NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=RANK, lora_alpha=ALPHA).convert_module(model)


def _peft_bf16(model: nn.Module) -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(model, _lora_config())


def _to_linear4bit(model: nn.Module) -> None:
    import bitsandbytes as bnb

    for name, child in list(model.named_modules()):
        if isinstance(child, nn.Linear) and name.rsplit(".", 1)[-1] in ATTENTION:
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, q.to(child.weight.device))  # .to() quantizes


def _peft_bnb(model: nn.Module) -> nn.Module:
    from peft import get_peft_model, prepare_model_for_kbit_training

    _to_linear4bit(model)
    model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, _lora_config())


BUILD = {"memkit": _memkit, "peft-bf16": _peft_bf16, "peft-bnb-qlora": _peft_bnb}


def _batch() -> dict[str, torch.Tensor]:
    dm = ByteTextDataModule(batch_size=4, seq_len=64, batch_format="hf", max_bytes=200_000)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


class _Run:
    """One implementation: its model, optimizer and measurements."""

    def __init__(self, impl: str, family: str, quick: bool):
        self.impl = impl
        self.model = BUILD[impl](_model(family, quick))
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trainable, lr=LR)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self, batch) -> None:
        loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))

    def resident_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers(), self.opt.state]
        for p in self.model.parameters():  # bitsandbytes keeps absmax & co. beside the packed data
            tensors += [t for a in ("quant_state", "SCB") for t in tensors_in(getattr(p, a, None), max_depth=3)]
        return unique_storage_bytes(tensors)

    def experts_quantized(self) -> bool:
        from lightning_memkit.hf.qlora import QLoRAExperts

        return any(isinstance(m, QLoRAExperts) for m in self.model.modules())


def _measure(runs: list[_Run], batch, steps: int) -> dict[str, int]:
    for run in runs:  # warm-up: the optimizer state exists after it
        run.step(batch)
    peaks = {}
    for run in runs:
        with LivePeak() as lp:
            run.step(batch)
        peaks[run.impl] = lp.peak_bytes
    for _ in range(steps - 2):
        for run in runs:
            run.seconds.append(time_once(lambda r=run: r.step(batch)))
    return peaks


def _row(run: _Run, peak: int, base_seconds: float) -> dict:
    resident = run.resident_bytes()
    seconds = statistics.median(run.seconds)
    return {"impl": run.impl, "resident_bytes": resident, "step_peak_bytes": peak, "total_bytes": resident + peak,
            "total_MiB": mib(resident + peak), "trainable_params": sum(p.numel() for p in run.trainable),
            "experts_quantized": run.experts_quantized(), "time_vs_peft_bf16": round(seconds / base_seconds, 3),
            "loss_first": round(run.losses[0], 4), "loss_last": round(run.losses[-1], 4)}


def _failed(impl: str, err: BaseException) -> dict:
    line = traceback.format_exception_only(type(err), err)[-1].strip()
    return {"impl": impl, "error": line[:300]}


def case(family: str, quick: bool) -> dict:
    steps = 4 if quick else 10
    batch = _batch()
    runs, rows = [_Run("memkit", family, quick), _Run(BASELINE, family, quick)], {}
    try:
        runs.append(_Run(PEER, family, quick))
    except Exception as err:  # recorded, not hidden: a peer that does not run here is a result too
        rows[PEER] = _failed(PEER, err)
    peaks = _measure(runs, batch, steps)
    base = next(r for r in runs if r.impl == BASELINE)
    for run in runs:
        rows[run.impl] = _row(run, peaks[run.impl], statistics.median(base.seconds))
    ordered = [rows[i] for i in IMPLS]
    ok = [r for r in ordered if "error" not in r]
    ours = rows["memkit"]
    falls = all(r["loss_last"] < r["loss_first"] for r in ok)
    met = falls and all(ours["total_bytes"] < r["total_bytes"] for r in ok if r is not ours)
    model = runs[0].model
    hidden = model.config.hidden_size
    shape = (f"hidden {hidden}, {model.config.num_hidden_layers} layers, 8 experts of width {2 * hidden} (2 per "
             f"token), batch 4 x 64, LoRA rank {RANK} on q/k/v/o and per expert, {steps} AdamW steps")
    goal = "memkit's resident + step peak below every peer's, and the loss falls in all"
    return record("hf_qlora training step", f"{family}, {shape}", BASELINE, ordered, goal, met)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark measures with LivePeak on CPU; allowed: 'cpu'")
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [case(family, quick) for family in ("qwen3_moe", "gpt_oss")]
    finally:
        torch.set_num_threads(threads)
