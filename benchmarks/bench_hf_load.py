"""An MXFP4 GPT-OSS checkpoint into a bf16 model: host RSS, tensor bytes and time, memkit against transformers.

A synthetic GPT-OSS checkpoint laid out as the released ones (expert weights as ``*_blocks`` / ``*_scales``,
everything else bf16, two shards and an index, ``config.json`` with an ``mxfp4`` quantization config) is
written to a temporary directory, then loaded to a bf16 model on the CPU by:

- ``transformers from_pretrained`` (baseline): ``AutoModelForCausalLM.from_pretrained(dir,
  quantization_config=Mxfp4Config(dequantize=True))``, as it runs by default (4 reader threads);
- ``transformers from_pretrained, sequential``: the same with ``HF_DEACTIVATE_ASYNC_LOAD=1``;
- ``memkit load_mxfp4_into``: the model built on the meta device (``from_config(config,
  dtype=torch.bfloat16)``) and filled by ``load_mxfp4_into(model, dir, device="cpu",
  init_buffers=init_hf_buffers)``.

Each load runs in a fresh Python process, so that one loader's allocator cache, freed heap and mapped pages do
not count for another. Per load: the host RSS rise during the load (``HostRSS``: the kernel's peak RSS,
``VmHWM``, reset when the load starts; memory-mapped file pages included), what is still resident after it,
and the wall time of the load (imports excluded). LivePeak's tensor bytes are measured in separate runs
(its dispatch mode costs time); it sees the calling thread only, so for transformers it is read from the
sequential loader. All loads of one run give the same state dict (checked).

    python -m benchmarks.run --only hf_load [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import mib, record

BASELINE = "transformers from_pretrained"
SEQUENTIAL = "transformers from_pretrained, sequential"
MEMKIT = "memkit load_mxfp4_into"
IMPLS = (BASELINE, SEQUENTIAL, MEMKIT)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _config(quick: bool, quantized: bool = True):
    from lightning_memkit.demo.hf_models import tiny_hf_config

    hidden, layers, experts, vocab = (128, 2, 4, 1024) if quick else (512, 8, 16, 8192)
    config = tiny_hf_config("gpt_oss", hidden_size=hidden, num_layers=layers, num_experts=experts,
                            vocab_size=vocab, dtype="bfloat16")
    if quantized:
        config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    return config


def _synthetic(name: str, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, torch.Tensor]:
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] <- [E, out, in // 32, 16]
        experts, inp, out = shape
        return {name + "_blocks": torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8,
                                                generator=gen),
                name + "_scales": torch.randint(119, 128, (experts, out, inp // 32), dtype=torch.uint8, generator=gen)}
    if name.endswith("norm.weight"):
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}


def write_checkpoint(directory: Path, quick: bool) -> int:
    """Write the checkpoint (two shards + index + config.json); return the bytes of the bf16 model it makes."""
    import transformers
    from safetensors.torch import save_file

    config = _config(quick)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(quick, quantized=False), dtype=torch.bfloat16)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gen = torch.Generator().manual_seed(0)
    half = config.num_hidden_layers // 2
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                  "model-00002-of-00002.safetensors": {}}
    for name, shape in shapes.items():
        late = name.startswith("model.layers.") and int(name.split(".")[2]) >= half or name.startswith("lm_head")
        shards[f"model-0000{2 if late else 1}-of-00002.safetensors"].update(_synthetic(name, shape, gen))
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(directory)
    return model_bytes


# -- one load, in a fresh process ------------------------------------------------------------------------------
def _load(impl: str, directory: str):
    import transformers

    if impl == MEMKIT:
        from lightning_memkit.hf.meta_init import init_hf_buffers
        from lightning_memkit.loading import load_mxfp4_into

        config = transformers.AutoConfig.from_pretrained(directory)
        config.quantization_config = None
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        load_mxfp4_into(model, directory, device="cpu", init_buffers=init_hf_buffers)  # measure=True, as by default
        return model
    quant = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=quant)


def _worker(impl: str, directory: str, live_peak: bool, digest_path: str) -> None:
    import time

    import transformers
    import transformers.integrations.mxfp4  # noqa: F401

    import lightning_memkit.hf.meta_init  # noqa: F401
    import lightning_memkit.loading  # noqa: F401
    from lightning_memkit.memory import HostRSS, LivePeak

    torch.set_num_threads(1)
    with torch.device("meta"):  # imports the model's code (lazy in transformers) before the measured block
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    lp = LivePeak() if live_peak else None
    with HostRSS() as rss:
        started = time.perf_counter()
        if lp is not None:
            with lp:
                model = _load(impl, directory)
        else:
            model = _load(impl, directory)
        seconds = time.perf_counter() - started
    if digest_path:
        torch.save({k: v.float().sum() for k, v in model.state_dict().items()}, digest_path)
    print(json.dumps({"seconds": seconds, "rss_start": rss.start_bytes, "rss_peak": rss.peak_bytes,
                      "rss_end": rss.end_bytes, "method": rss.method,
                      "live_peak": lp.peak_bytes if lp is not None else None,
                      "meta_left": [n for n, t in model.state_dict().items() if t.is_meta]}))


def _spawn(impl: str, directory: Path, live_peak: bool = False, digest: Path | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if impl == SEQUENTIAL:
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.bench_hf_load", impl, str(directory), str(int(live_peak)),
           str(digest or "")]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{impl} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_state(digests: list[Path]) -> None:
    first = torch.load(digests[0])
    for other in digests[1:]:
        second = torch.load(other)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), other


def run(device: str = "cpu", quick: bool = False) -> list[dict]:
    if device != "cpu":
        raise ValueError(f"device={device!r}: this benchmark measures host memory; run it with --device cpu")
    repeat = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gpt-oss-mxfp4"
        directory.mkdir()
        model_bytes = write_checkpoint(directory, quick)
        ckpt_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        digests = [Path(tmp) / f"{i}.pt" for i in range(len(IMPLS))]
        runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
        for r in range(repeat):  # interleaved, so a busy spell of the machine hits every loader alike
            for i, impl in enumerate(IMPLS):
                runs[impl].append(_spawn(impl, directory, digest=digests[i] if r == 0 else None))
        _same_state(digests)
        live = {impl: _spawn(impl, directory, live_peak=True)["live_peak"] for impl in (SEQUENTIAL, MEMKIT)}
    return [_entry(runs, live, model_bytes, ckpt_bytes, quick)]


def _entry(runs: dict[str, list[dict]], live: dict[str, int], model_bytes: int, ckpt_bytes: int, quick: bool) -> dict:
    median = {impl: statistics.median(r["seconds"] for r in rs) for impl, rs in runs.items()}
    rows = []
    for impl, rs in runs.items():
        rise = max(r["rss_peak"] - r["rss_start"] for r in rs)  # the worst of the runs
        kept = statistics.median(r["rss_end"] - r["rss_start"] for r in rs)
        assert all(not r["meta_left"] for r in rs), impl
        rows.append({"impl": impl, "rss_peak_rise_bytes": rise, "rss_peak_rise_MiB": mib(rise),
                     "rss_rise_vs_model": round(rise / model_bytes, 3), "rss_kept_MiB": mib(kept),
                     "live_peak_MiB": mib(live[impl]) if impl in live else "n/a (reader threads)",
                     "wall_time_vs_baseline": round(median[impl] / median[BASELINE], 3),
                     "seconds_median": round(median[impl], 2)})
    ours = rows[2]["rss_peak_rise_bytes"]
    met = ours <= 1.25 * model_bytes and ours < min(rows[0]["rss_peak_rise_bytes"], rows[1]["rss_peak_rise_bytes"])
    config = _config(quick)
    case = (f"GPT-OSS, {config.num_hidden_layers} layers x {config.num_local_experts} experts, hidden "
            f"{config.hidden_size}, vocabulary {config.vocab_size}: {mib(model_bytes)} MiB of bf16 weights from "
            f"{mib(ckpt_bytes)} MiB of MXFP4 safetensors (2 shards); {len(next(iter(runs.values())))} runs per "
            f"loader, each in a fresh process; RSS method of the runs: "
            f"{', '.join(sorted({r['method'] for rs in runs.values() for r in rs}))}")
    goal = "memkit host RSS peak rise <= 1.25x model bytes and below both transformers loads"
    return record("MXFP4 GPT-OSS checkpoint to a bf16 model (host memory)", case, BASELINE, rows, goal, met)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4])
