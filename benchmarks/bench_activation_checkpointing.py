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

Case 4 (torch.compile, not in ``--quick``): the case-1 model and batch, the step compiled with inductor
(``torch.compile`` of the loss function: forward, loss and backward in one graph, as Lightning compiles
``training_step``): without recomputation (baseline), with ``torch._functorch.config.activation_memory_budget``
at 0.7, 0.5 and 0.3 (each compiled afresh), and memkit at each of those points: a one-step ``Trainer.fit`` of
the compiled model with ``ActivationCheckpointing(policy={Block}, budget_bytes=<that point's measured peak>,
selective=True)`` plans none/selective/full per block, and its plan is applied with ``checkpoint_modules`` to
a copy compiled the same way. Memory: the forward+backward peak counted by the allocator
(``AllocatorPeak``: LivePeak's dispatch mode would make dynamo run the step eagerly). Time: the full step
(AdamW included), all seven variants interleaved round by round. A point is dominated when memkit's peak is
<= its peak and memkit's step time is <= its time (median of the per-round ratios <= 1).

    python -m benchmarks.run --only activation_checkpointing [--quick] [--device cuda]
"""

from __future__ import annotations

import contextlib
import copy
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
from lightning_memkit.measure.allocator_peak import AllocatorPeak
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


COMPILE_BUDGETS = (0.7, 0.5, 0.3)


class _CompiledStepLM(TinyLM):
    """TinyLM whose ``training_step`` does not call ``self.log``: under Lightning 2.6 and torch 2.13 a compiled
    ``training_step`` that logs fails inside dynamo (``LightningModule.log`` inspects ``self.training_step``)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)


def _inductor(budget: float | None):
    """A fresh inductor backend (its own dynamo cache entries), compiling under ``activation_memory_budget``."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget):
            return compile_fx(gm, example_inputs)

    return backend


def _compiled_variant(base, batch, device: str, budget: float | None = None, modes: dict | None = None):
    """(step, peak): a copy of ``base`` with ``modes`` recomputed, its loss compiled; the full step and its peak."""
    model = copy.deepcopy(base)
    if modes:
        blocks = dict(model.named_modules())
        checkpoint_modules([(name, blocks[name]) for name in modes], mode=modes)  # for the model's lifetime
    loss_fn = torch.compile(model._loss, backend=_inductor(budget))
    opt = model.configure_optimizers()

    def fwd_bwd():
        loss_fn(batch).backward()
        model.zero_grad(set_to_none=True)

    def step():
        loss_fn(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fwd_bwd()  # compiles
    fwd_bwd()
    with AllocatorPeak(device) as counter:
        fwd_bwd()
    return step, counter.peak_bytes


def _memkit_plan(base, batch, device: str, budget: int) -> tuple[dict, ActivationCheckpointing]:
    """The modes ``ActivationCheckpointing(selective=True, budget_bytes=budget)`` picks in a compiled one-step fit."""
    model = _CompiledStepLM(**{k: base.hparams[k] for k in ("d_model", "n_layers", "n_heads", "seq_len")})
    model.load_state_dict(base.state_dict())
    callback = ActivationCheckpointing(policy={Block}, budget_bytes=budget, selective=True)
    trainer = L.Trainer(max_steps=1, accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    dataset = torch.utils.data.TensorDataset(*(t.cpu() for t in batch))
    data = torch.utils.data.DataLoader(dataset, batch_size=len(batch[0]))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit(torch.compile(model), data)
    return dict(callback.modes), callback


def _interleaved(steps: dict, rounds: int, device: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(rounds):
        for name in (list(steps) if i % 2 == 0 else list(reversed(steps))):
            times[name].append(time_once(steps[name], device))
    return times


def _modes_text(modes: dict, names: list[str]) -> str:
    return " ".join({"full": "F", "selective": "S"}.get(modes.get(name), "-") for name in names)


def _compile_variants(device: str, quick: bool):
    """Build and measure the seven compiled variants; returns (label, names, steps, peaks, plans)."""
    base, x, y, label = _setup(device, quick)
    batch, names = (x, y), [n for n, _ in select_modules(base, {Block})]
    steps, peaks, plans = {}, {}, {}
    steps["compiled"], peaks["compiled"] = _compiled_variant(base, batch, device)
    for b in COMPILE_BUDGETS:
        steps[f"budget {b}"], peaks[f"budget {b}"] = _compiled_variant(base, batch, device, budget=b)
    for b in COMPILE_BUDGETS:
        modes, _callback = _memkit_plan(base, batch, device, peaks[f"budget {b}"])
        plans[f"memkit @ {b}"] = modes
        steps[f"memkit @ {b}"], peaks[f"memkit @ {b}"] = _compiled_variant(base, batch, device, modes=modes)
    return label, names, steps, peaks, plans


def _compile_case(device: str, quick: bool) -> dict:
    torch._dynamo.reset()  # earlier cases ran TinyLM under LivePeak: dynamo had marked its code to be skipped
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        label, names, steps, peaks, plans = _compile_variants(device, quick)
        rounds = 6 if quick else 14
        times = _interleaved(steps, rounds, device)

    def ratio(name: str, ref: str) -> float:
        return statistics.median(t / r for t, r in zip(times[name], times[ref]))

    rows = [{"impl": f"torch.compile activation_memory_budget={name.split()[1]}" if name.startswith("budget") else name,
             "peak_bytes": peaks[name], "peak_vs_baseline": round(peaks[name] / peaks["compiled"], 3),
             "step_time_s": round(statistics.median(times[name]), 4),
             "time_vs_baseline": round(ratio(name, "compiled"), 3),
             "blocks (F full, S selective)": _modes_text(plans[name], names) if name in plans else ""}
            for name in steps]
    verdicts, met = [], True
    for b in COMPILE_BUDGETS:
        point, mine = f"budget {b}", f"memkit @ {b}"
        rel = ratio(mine, point)
        ok_peak, ok_time = peaks[mine] <= peaks[point], rel <= 1.0
        met &= ok_peak and ok_time
        verdicts.append(f"{b}: peak {peaks[mine]:,} <= {peaks[point]:,} {'yes' if ok_peak else 'NO'}, time "
                        f"{rel:.3f}x of its {'yes' if ok_time else 'NO'}")
    case = (f"{label} compiled (torch.compile, inductor) on the {device.upper()}: activation_memory_budget against "
            "ActivationCheckpointing(selective=True, budget_bytes=that point's peak); forward+backward peak by the "
            f"allocator, forward+backward+AdamW time, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds")
    goal = "memkit at each point's peak: peak <= and step time <= the point's (" + "; ".join(verdicts) + ")"
    return record("activation_checkpointing", case, "the same compiled step with nothing recomputed", rows,
                  goal=goal, met=bool(met))


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        entries = [_policy_case(device, quick), _budget_case(device, quick)]
        entries += [_hf_case(device, quick, family) for family in HF_FAMILIES]
        if not quick:  # seven inductor compilations and three compiled planning fits: minutes, not seconds
            entries.append(_compile_case(device, quick))
        if device.startswith("cuda") and not quick:
            entries.append(_policy_case(device, quick, large=True))
        return entries
    finally:
        torch.set_num_threads(before)
