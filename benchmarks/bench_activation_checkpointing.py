"""Activation checkpointing of TinyLM's blocks: how much of the step's activation peak goes, at what time cost.

Case 1 (policy): one TinyLM training step (the ``make demo`` model and batch unless ``--quick``) with
nothing recomputed (baseline) and with every ``Block`` recomputed through
``lightning_memkit.memory.checkpoint_modules`` (what ``ActivationCheckpointing(policy={Block})`` applies).
Memory: the forward+backward peak of new storage (``LivePeak`` on CPU, ``max_memory_allocated`` delta on
CUDA; weights and optimizer state exist before and are not counted). Time: the full step (forward,
backward, AdamW), variants interleaved step by step, ratio = median of the per-pair ratios.

Case 2 (budget): ``ActivationCheckpointing(policy={Block}, budget_bytes=B)`` in a one-step
``Trainer.fit`` for budgets between the baseline and the all-recomputed peak; the row shows the layers
the callback chose, its predicted and measured peaks, and (brute force over every subset of blocks,
measured the same way: ``LivePeak`` on the training device) the fewest blocks any subset needs to stay
within ``B``.

Case 3 (Hugging Face): tiny random Llama, Qwen3-MoE and GPT-OSS causal LMs (hidden 64, 4 decoder layers,
sequence 512, batch 4; 256 x 2 with ``--quick``) trained on their own shifted-label loss, with nothing
recomputed, with what ``ActivationCheckpointing()`` applies (``policy="auto"``: every decoder layer, KV
cache off), and with transformers' own ``activation_checkpointing_enable()`` (the peer, same run). Same
peak and time measurement as case 1 (``LivePeak``, AdamW step timed, interleaved pairs).

    python -m benchmarks.run --only activation_checkpointing [--quick] [--device cuda]
"""

from __future__ import annotations

import contextlib
import io
import itertools
import statistics

import lightning as L
import torch
import torch.nn.functional as F

from benchmarks.common import peak_of, record, time_once
from lightning_memkit.callbacks import ActivationCheckpointing
from lightning_memkit.demo import TinyLM
from lightning_memkit.demo.hf_models import HF_FAMILIES, tiny_hf_causal_lm
from lightning_memkit.demo.tiny_lm import Block
from lightning_memkit.hf.layers import decoder_layers, kv_cache_off
from lightning_memkit.memory import LivePeak, checkpoint_modules, select_modules

THREADS = 1  # one intra-op thread: stable ratios on a shared 2-core machine


def _setup(device: str, quick: bool, large: bool = False):
    torch.manual_seed(0)
    if large:  # GPU-sized: kernels long enough that launch overhead does not dominate the step
        model, (bs, seq) = TinyLM(d_model=1024, n_layers=8, n_heads=16, seq_len=1024), (8, 1024)
    elif quick:
        model, (bs, seq) = TinyLM(d_model=64, n_layers=4, n_heads=2, seq_len=64), (4, 64)
    else:
        model, (bs, seq) = TinyLM(), (16, 128)
    model = model.to(device)
    x = torch.randint(0, 256, (bs, seq), device=device)
    y = torch.randint(0, 256, (bs, seq), device=device)
    label = f"TinyLM d_model={model.hparams.d_model} n_layers={model.hparams.n_layers} batch {bs}x{seq}"
    return model, x, y, label


def _fwd_bwd(model, x, y):
    def fn():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    return fn


def _peak(model, x, y, device, names=()):
    modules = dict(model.named_modules())
    with checkpoint_modules([(n, modules[n]) for n in names]):
        return peak_of(_fwd_bwd(model, x, y), device=device)


def _live_peak(model, x, y, device, names=()):
    """The peak as the callback measures it: LivePeak's count on the training device (on CUDA too)."""
    modules = dict(model.named_modules())
    with checkpoint_modules([(n, modules[n]) for n in names]), LivePeak() as lp:
        _fwd_bwd(model, x, y)()
    return lp.by_device[str(x.device)].peak


def _policy_case(device: str, quick: bool, large: bool = False) -> dict:
    model, x, y, label = _setup(device, quick, large)
    opt = model.configure_optimizers()
    blocks = select_modules(model, {Block})

    def step():
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def recomputed():
        with checkpoint_modules(blocks):
            step()

    for _ in range(2):
        step()
        recomputed()
    base_peak = _peak(model, x, y, device)
    ckpt_peak = _peak(model, x, y, device, [n for n, _ in blocks])
    pairs = 4 if quick else 10
    base_t, ckpt_t = [], []
    for i in range(pairs):
        if i % 2 == 0:
            base_t.append(time_once(step, device))
            ckpt_t.append(time_once(recomputed, device))
        else:
            ckpt_t.append(time_once(recomputed, device))
            base_t.append(time_once(step, device))
    ratio = statistics.median(c / b for c, b in zip(ckpt_t, base_t))
    cut = 1 - ckpt_peak / base_peak
    rows = [
        {"impl": "nothing recomputed", "peak_bytes": base_peak, "peak_vs_baseline": 1.0,
         "step_time_s": round(statistics.median(base_t), 4), "time_vs_baseline": 1.0},
        {"impl": f"every Block recomputed ({len(blocks)})", "peak_bytes": ckpt_peak,
         "peak_vs_baseline": round(ckpt_peak / base_peak, 3), "step_time_s": round(statistics.median(ckpt_t), 4),
         "time_vs_baseline": round(ratio, 3)},
    ]
    case = (f"{label} on {device}: forward+backward peak, forward+backward+AdamW time, {torch.get_num_threads()} "
            f"thread(s), {pairs} interleaved pairs")
    return record("activation_checkpointing", case, "the same step with nothing recomputed", rows,
                  goal="peak cut >= 50% at <= 1.4x step time", met=bool(cut >= 0.5 and ratio <= 1.4))


def _budget_case(device: str, quick: bool) -> dict:
    model, x, y, label = _setup(device, quick)
    names = [n for n, _ in select_modules(model, {Block})]
    best = {k: min(_live_peak(model, x, y, device, c) for c in itertools.combinations(names, k))
            for k in range(len(names) + 1)}
    rows, all_minimal = [], True
    for frac in (0.85, 0.6, 0.35):
        budget = int(best[len(names)] + frac * (best[0] - best[len(names)]))
        callback = ActivationCheckpointing(policy={Block}, budget_bytes=budget)
        trainer = L.Trainer(max_steps=1, accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[callback])
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=len(x))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer.fit(model, data)
        fewest = min(k for k, peak in best.items() if peak <= budget)
        all_minimal &= len(callback.checkpointed) == fewest and callback.measured_peak_bytes <= budget
        rows.append({
            "impl": f"budget {budget:,} B", "layers_chosen": ", ".join(callback.checkpointed) or "none",
            "n_layers": len(callback.checkpointed), "fewest_possible": fewest,
            "predicted_peak_bytes": callback.plan.predicted_peak, "measured_peak_bytes": callback.measured_peak_bytes,
        })
        model.to(device)
    case = f"{label} on {device}: budgets between the all-recomputed and the baseline peak"
    return record("activation_checkpointing", case, "brute force over every subset of blocks (measured)", rows,
                  goal="within budget with the fewest blocks any subset needs", met=all_minimal)


def _hf_variants(model, ids):
    """name -> context manager factory: the three ways to run one HF training step."""
    def memkit():
        stack = contextlib.ExitStack()
        stack.enter_context(kv_cache_off(model))
        stack.enter_context(checkpoint_modules(decoder_layers(model)))
        return stack

    @contextlib.contextmanager
    def hf_own():
        model.activation_checkpointing_enable()
        try:
            yield
        finally:
            model.activation_checkpointing_disable()

    return {"nothing recomputed": contextlib.nullcontext, "memkit ActivationCheckpointing()": memkit,
            "transformers activation_checkpointing_enable()": hf_own}


def _hf_case(device: str, quick: bool, family: str) -> dict:
    bs, seq = (2, 256) if quick else (4, 512)
    model = tiny_hf_causal_lm(family, seed=0, num_layers=4).to(device).train()
    ids = torch.randint(0, 256, (bs, seq), generator=torch.Generator().manual_seed(0)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    variants = _hf_variants(model, ids)

    def step(ctx):
        def fn():
            with ctx():
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return fn

    def fwd_bwd(ctx):
        def fn():
            with ctx():
                model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return fn

    for ctx in variants.values():
        step(ctx)()
    peaks = {name: peak_of(fwd_bwd(ctx), device=device) for name, ctx in variants.items()}
    pairs = 3 if quick else 6
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(pairs):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(time_once(step(variants[name]), device))
    base = "nothing recomputed"
    rows = [{"impl": name, "peak_bytes": peaks[name], "peak_vs_baseline": round(peaks[name] / peaks[base], 3),
             "step_time_s": round(statistics.median(times[name]), 4),
             "time_vs_baseline": round(statistics.median(t / b for t, b in zip(times[name], times[base])), 3)}
            for name in variants]
    memkit = rows[1]
    case = (f"tiny {type(model).__name__} (hidden 64, 4 layers) batch {bs}x{seq} on {device}: forward+backward peak, "
            f"forward+backward+AdamW time, {torch.get_num_threads()} thread(s), {pairs} interleaved rounds")
    return record("activation_checkpointing", case, "the same step with nothing recomputed", rows,
                  goal="peak <= 0.5x the baseline", met=bool(memkit["peak_vs_baseline"] <= 0.5))


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        entries = [_policy_case(device, quick), _budget_case(device, quick)]
        entries += [_hf_case(device, quick, family) for family in HF_FAMILIES]
        if device.startswith("cuda") and not quick:
            entries.append(_policy_case(device, quick, large=True))
        return entries
    finally:
        torch.set_num_threads(before)
