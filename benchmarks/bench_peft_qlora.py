"""QLoRA training steps on a peft model: memkit's plugin on a ``peft.get_peft_model`` model against peft's QLoRA route.

Model: a random Llama built from its config (hidden 512, 4 decoder layers, MLP width 1024, vocabulary 256; ``--quick``:
hidden 128, 2 layers), saved once in bfloat16 so that every implementation starts from the same weights. LoRA rank 8
(alpha 16, no dropout) on ``q/k/v/o_proj`` and ``gate/up/down_proj``, the adapters' initialisation seeded alike:

- ``peft-bnb-qlora`` (baseline, peft's own route): ``AutoModelForCausalLM.from_pretrained(quantization_config=
  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bfloat16),
  device_map="cpu")``, then ``peft.prepare_model_for_kbit_training(use_gradient_checkpointing=False)`` (no
  recomputation, as in the others; it casts the unquantized parameters to float32, as it does for every model) and
  ``get_peft_model(LoraConfig(...))``;
- ``memkit+peft``: the bfloat16 model, ``get_peft_model(LoraConfig(...))``, then
  ``NoSaveBitsandbytesPrecision("nf4", "bfloat16").convert_module`` (every peft ``base_layer`` and the other Linear
  layers in nf4 with the no-save matmul, peft's adapters float32 and trainable, the rest frozen in bfloat16);
- ``memkit+peft bf16 adapters``: the same with ``get_peft_model(..., autocast_adapter_dtype=False)``: peft's
  adapters stay bfloat16 (peft's default, above, makes them float32 and casts each adapted layer's input to
  float32, a copy that backward keeps);
- ``memkit lora_rank``: the bfloat16 model, ``NoSaveBitsandbytesPrecision("nf4", "bfloat16", lora_rank=8)`` (the
  built-in adapters: float32 weights, products in the input's dtype; for reference).

Per implementation, on one fixed batch of byte text (4 x 64 tokens) with AdamW (lr 1e-2) over the trainable
parameters: ``resident_bytes`` (distinct storage of parameters, buffers, bitsandbytes quant states and AdamW state
after a warm-up step), ``step_peak_bytes`` (``LivePeak`` over forward + backward + optimizer step + ``zero_grad``: new
storage only), their sum, the time of a step relative to the baseline (steps interleaved; medians) and the loss at
the first and the last step. An implementation that does not run here is recorded with its error.

    python -m benchmarks.run --only peft_qlora [--quick]
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import mib, record, time_once
from lightning_memkit.demo import ByteTextDataModule
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm
from lightning_memkit.measure.storage import tensors_in, unique_storage_bytes
from lightning_memkit.memory import LivePeak

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine
BASELINE = "peft-bnb-qlora"
OURS = "memkit+peft"
OURS_BF16 = "memkit+peft bf16 adapters"
BUILTIN = "memkit lora_rank"
IMPLS = (OURS, BASELINE, OURS_BF16, BUILTIN)
RANK, ALPHA, LR = 8, 16, 1e-2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)


def _get_peft_model(model: nn.Module, autocast_adapter_dtype: bool = True) -> nn.Module:
    from peft import get_peft_model

    torch.manual_seed(1)  # the same adapter initialisation in every peft route
    return get_peft_model(model, _lora_config(), autocast_adapter_dtype=autocast_adapter_dtype)


def _saved(quick: bool, folder: Path) -> Path:
    hidden, layers = (128, 2) if quick else (512, 4)
    model = tiny_hf_causal_lm("llama", seed=0, dtype=torch.bfloat16, hidden_size=hidden, num_layers=layers)
    model.save_pretrained(folder)
    return folder


def _load(folder: Path) -> nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


def _plugin(**kwargs):
    from lightning_memkit.plugins import NoSaveBitsandbytesPrecision

    return NoSaveBitsandbytesPrecision("nf4", "bfloat16", **kwargs)


def _memkit_peft(folder: Path, autocast_adapter_dtype: bool = True):
    plugin = _plugin()
    return plugin.convert_module(_get_peft_model(_load(folder), autocast_adapter_dtype)), plugin


def _memkit_builtin(folder: Path):
    plugin = _plugin(lora_rank=RANK, lora_alpha=ALPHA)
    return plugin.convert_module(_load(folder)), plugin


def _peft_bnb(folder: Path):
    import transformers
    from peft import prepare_model_for_kbit_training

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu",
                                                              dtype=torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return _get_peft_model(model), None


BUILD = {OURS: _memkit_peft, BASELINE: _peft_bnb, OURS_BF16: lambda folder: _memkit_peft(folder, False),
         BUILTIN: _memkit_builtin}


def _batch() -> dict[str, torch.Tensor]:
    dm = ByteTextDataModule(batch_size=4, seq_len=64, batch_format="hf", max_bytes=200_000)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


class _Run:
    """One implementation: its model, optimizer and measurements."""

    def __init__(self, impl: str, folder: Path):
        self.impl = impl
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.plugin = BUILD[impl](folder)
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trainable, lr=LR)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self, batch) -> None:
        context = self.plugin.forward_context() if self.plugin is not None else contextlib.nullcontext()
        with context:  # as in a Trainer with the plugin
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

    def quantized_layers(self) -> int:
        import bitsandbytes as bnb

        return sum(isinstance(m, bnb.nn.Linear4bit) for m in self.model.modules())


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


def _row(run: _Run, peak: int, base_seconds: float | None) -> dict:
    resident = run.resident_bytes()
    seconds = statistics.median(run.seconds)
    return {"impl": run.impl, "resident_bytes": resident, "step_peak_bytes": peak, "total_bytes": resident + peak,
            "total_MiB": mib(resident + peak), "trainable_params": sum(p.numel() for p in run.trainable),
            "nf4_layers": run.quantized_layers(),
            "time_vs_baseline": None if base_seconds is None else round(seconds / base_seconds, 3),
            "loss_first": round(run.losses[0], 4), "loss_last": round(run.losses[-1], 4)}


def _failed(impl: str, err: BaseException) -> dict:
    line = traceback.format_exception_only(type(err), err)[-1].strip()
    return {"impl": impl, "error": f"does not run here: {line[:300]}"}


def case(quick: bool) -> dict:
    steps = 4 if quick else 10
    batch = _batch()
    runs, rows = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _saved(quick, Path(tmp))
        for impl in IMPLS:
            try:
                runs.append(_Run(impl, folder))
            except Exception as err:  # recorded, not hidden: a route that does not run here is a result too
                rows[impl] = _failed(impl, err)
    peaks = _measure(runs, batch, steps)
    base = next((r for r in runs if r.impl == BASELINE), None)
    for run in runs:
        rows[run.impl] = _row(run, peaks[run.impl], None if base is None else statistics.median(base.seconds))
    ordered = [rows[i] for i in IMPLS]
    ours, theirs = rows[OURS], rows[BASELINE]
    met = None
    if "error" not in ours and "error" not in theirs:
        met = ours["step_peak_bytes"] < theirs["step_peak_bytes"] and ours["loss_last"] < ours["loss_first"]
    config = runs[0].model.config
    shape = (f"Llama hidden {config.hidden_size}, {config.num_hidden_layers} layers, MLP {config.intermediate_size}, "
             f"vocabulary {config.vocab_size}, batch 4 x 64, LoRA rank {RANK} on q/k/v/o/gate/up/down, {steps} AdamW "
             "steps")
    goal = (f"{OURS}'s step peak below {BASELINE}'s (peft's QLoRA route, measured in the same run), and its loss "
            "falls")
    return record("peft_qlora training step", shape, BASELINE, ordered, goal, met)


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark measures with LivePeak on CPU; allowed: 'cpu'")
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return [case(quick)]
    finally:
        torch.set_num_threads(threads)
