import contextlib
import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lightning_memkit.loading import dequantize_mxfp4, load_mxfp4_into
from lightning_memkit.loading.mxfp4 import _Tables, chunk_transient_bytes
from lightning_memkit.loading.safetensors_loader import _Reader, read_safetensors_header
from lightning_memkit.measure import host_rss
from lightning_memkit.memory import LivePeak

LAYERS, E, H, INTER, VOCAB = 3, 2, 64, 32, 48
ROWS = 8  # rows_per_chunk used in the bounds below


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * INTER, dtype=torch.bfloat16))  # [E, in, out]
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * INTER, dtype=torch.bfloat16))
        self.down_proj = nn.Parameter(torch.randn(E, INTER, H, dtype=torch.bfloat16))
        self.down_proj_bias = nn.Parameter(torch.randn(E, H, dtype=torch.bfloat16))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, dtype=torch.bfloat16)
        self.experts = Experts()


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.lm_head = nn.Linear(H, VOCAB, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.embed.weight  # tied: saved once
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))


def packed_checkpoint():
    """GPT-OSS-style tensors: expert weights as blocks/scales (rows = out features), the rest as they are."""
    ckpt = {"embed.weight": torch.randn(VOCAB, H).bfloat16(), "step": torch.tensor(7)}
    for i in range(LAYERS):
        p = f"layers.{i}"
        ckpt[f"{p}.router.weight"] = torch.randn(E, H).bfloat16()
        ckpt[f"{p}.router.bias"] = torch.randn(E).bfloat16()
        for name, (inp, outp) in {"gate_up_proj": (H, 2 * INTER), "down_proj": (INTER, H)}.items():
            ckpt[f"{p}.experts.{name}_blocks"] = torch.randint(0, 256, (E, outp, inp // 32, 16), dtype=torch.uint8)
            ckpt[f"{p}.experts.{name}_scales"] = torch.randint(118, 134, (E, outp, inp // 32), dtype=torch.uint8)
            ckpt[f"{p}.experts.{name}_bias"] = torch.randn(E, outp).bfloat16()
    return ckpt


def expected_state(ckpt):
    out = {}
    for name, t in ckpt.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = dequantize_mxfp4(t, ckpt[base + "_scales"], dtype=torch.bfloat16)
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model, state):
    current = model.state_dict()
    assert current.keys() >= state.keys()
    for k, v in state.items():
        assert torch.equal(current[k], v), k


def module_bytes(model):
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def table_bytes():
    with LivePeak() as lp:
        _Tables(torch.bfloat16, torch.device("cpu"))
    return lp.peak_bytes


@pytest.fixture
def ckpt_file(tmp_path):
    ckpt = packed_checkpoint()
    path = tmp_path / "model.safetensors"
    save_file(ckpt, path)
    return path, ckpt


# -- loading -----------------------------------------------------------------------------------------------


def test_loads_into_existing_parameters(ckpt_file):
    path, ckpt = ckpt_file
    model = MoE()
    params = {n: p for n, p in model.named_parameters()}
    result = load_mxfp4_into(model, path, rows_per_chunk=ROWS)
    assert_same_state(model, expected_state(ckpt))
    assert model.lm_head.weight is model.embed.weight
    assert all(p is params[n] for n, p in model.named_parameters())  # written in place
    assert sorted(result.dequantized) == sorted(f"layers.{i}.experts.{w}" for i in range(LAYERS)
                                                for w in ("gate_up_proj", "down_proj"))
    assert result.materialized == [] and result.ignored == [] and result.missing == []


def test_agrees_with_transformers_dequantization(ckpt_file):
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    path, ckpt = ckpt_file
    model = MoE()
    load_mxfp4_into(model, path)
    ref = mx.convert_moe_packed_tensors(ckpt["layers.1.experts.down_proj_blocks"],
                                        ckpt["layers.1.experts.down_proj_scales"], dtype=torch.bfloat16)
    assert torch.equal(model.layers[1].experts.down_proj.detach(), ref)


def test_file_reads_are_counted_by_live_peak(ckpt_file):
    """The bounds below are honest only if the tensors the loader reads show up in LivePeak: check it."""
    path, ckpt = ckpt_file
    name = "layers.0.experts.gate_up_proj_blocks"
    info = read_safetensors_header(path)[name]
    with contextlib.ExitStack() as stack, LivePeak() as lp:
        t = _Reader(stack).read(info)
        assert lp.live_bytes == t.numel() == ckpt[name].numel()
        assert torch.equal(t, ckpt[name])


def _rss_file():
    return host_rss._status_bytes("RssFile")


@pytest.mark.skipif(_rss_file() is None, reason="needs /proc/self/status (Linux)")
def test_reads_leave_no_mapped_pages_resident(tmp_path):
    """safetensors' memory map keeps every touched page of the file resident until it is closed; plain reads do not."""
    size = 32 * 2**20
    path = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.randn(size // 4 // 4) for i in range(4)}, path)
    model = nn.ParameterDict({f"w{i}": nn.Parameter(torch.zeros(size // 4 // 4)) for i in range(4)})
    before = _rss_file()
    result = load_mxfp4_into(model, path)
    assert _rss_file() - before < 4 * 2**20
    assert result.memory.tensor_peak_bytes == size // 4  # one entry read at a time
    with safe_open(str(path), framework="pt") as f:  # the same reads through the memory map, for contrast
        for name in f.keys():
            model[name].data.copy_(f.get_tensor(name))
        assert _rss_file() - before > 0.9 * size


def test_memory_report_matches_an_outer_live_peak(ckpt_file):
    path, _ = ckpt_file
    with torch.device("meta"):
        model = MoE()
    with LivePeak() as lp:
        result = load_mxfp4_into(model, path, device="cpu", rows_per_chunk=ROWS)
    assert result.memory.tensor_peak_bytes == lp.peak_bytes == result.memory.tensor_peak_by_device["cpu"]
    assert result.memory.rss_peak_bytes >= max(result.memory.rss_start_bytes, result.memory.rss_end_bytes)
    assert load_mxfp4_into(MoE(), path, measure=False).memory is None


def test_meta_model_peak_is_final_size_plus_one_entry(ckpt_file):
    path, ckpt = ckpt_file
    with torch.device("meta"):
        model = MoE()
    with LivePeak() as lp:
        result = load_mxfp4_into(model, path, device="cpu", rows_per_chunk=ROWS)
    final = module_bytes(model)
    largest_entry = max(
        ckpt[n].nbytes + ckpt[n[: -len("_blocks")] + "_scales"].nbytes if n.endswith("_blocks") else ckpt[n].nbytes
        for n in ckpt if not n.endswith("_scales")
    )
    chunk = chunk_transient_bytes(ROWS, max(H, INTER) // 32, torch.bfloat16)
    assert lp.live_bytes == final  # only the model's own tensors remain
    assert lp.peak_bytes <= final + largest_entry + chunk + table_bytes()
    assert lp.peak_bytes < final + sum(t.nbytes for n, t in ckpt.items() if "_blocks" in n)  # < naive
    assert_same_state(model, expected_state(ckpt))
    assert model.lm_head.weight is model.embed.weight and not model.embed.weight.is_meta
    assert "embed.weight" in result.materialized and "lm_head.weight" not in result.materialized


def test_preallocated_model_peak_is_one_entry(ckpt_file):
    path, ckpt = ckpt_file
    model = MoE()
    with LivePeak() as lp:
        load_mxfp4_into(model, path, rows_per_chunk=ROWS)
    pair = max(ckpt[n].nbytes + ckpt[n.replace("_blocks", "_scales")].nbytes for n in ckpt if "_blocks" in n)
    chunk = chunk_transient_bytes(ROWS, max(H, INTER) // 32, torch.bfloat16)
    assert lp.live_bytes == 0
    assert pair <= lp.peak_bytes <= pair + chunk + table_bytes()


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_directory(tmp_path, with_index):
    ckpt = packed_checkpoint()
    names = list(ckpt)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: ckpt[k] for k in keys}, tmp_path / file)
    if with_index:
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = MoE()
    load_mxfp4_into(model, tmp_path)
    assert_same_state(model, expected_state(ckpt))


def test_non_strict_reports_ignored_and_missing(tmp_path):
    ckpt = packed_checkpoint()
    ckpt["extra.weight"] = torch.zeros(3)
    del ckpt["layers.2.router.bias"]
    save_file(ckpt, tmp_path / "m.safetensors")
    model = MoE()
    before = model.layers[2].router.bias.detach().clone()
    result = load_mxfp4_into(model, tmp_path / "m.safetensors", strict=False)
    assert result.ignored == ["extra.weight"] and result.missing == ["layers.2.router.bias"]
    assert torch.equal(model.layers[2].router.bias, before)


def test_progress_bar_and_debug_log(ckpt_file, caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_memkit")
    path, _ = ckpt_file
    load_mxfp4_into(MoE(), path, progress=True)
    assert "loaded layers.0.experts.gate_up_proj" in caplog.text and "[MXFP4]" in caplog.text
    assert "dequantized from MXFP4" in caplog.text


# -- bad input: one ValueError naming the tensor, and nothing loaded -------------------------------------------


def _fails(model, path, match, **kw):
    state = snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        load_mxfp4_into(model, path, **kw)
    assert "nothing was loaded" in str(info.value) or "truncated" in str(info.value)
    assert_same_state(model, state)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("layers.1.experts.down_proj_scales"),
         "layers.1.experts.down_proj_blocks: has no matching layers.1.experts.down_proj_scales"),
        (lambda c: c.pop("layers.2.experts.gate_up_proj_blocks"),
         "layers.2.experts.gate_up_proj_scales: has no matching layers.2.experts.gate_up_proj_blocks"),
        (lambda c: c.update({"layers.0.experts.down_proj_scales": c["layers.0.experts.down_proj_scales"][
            :, :-1].contiguous()}),
         r"layers.0.experts.down_proj_scales: shape \[2, 63, 1\] does not match"),
        (lambda c: c.update({"layers.0.experts.down_proj_blocks": c["layers.0.experts.down_proj_blocks"].view(
            torch.int8)}), "layers.0.experts.down_proj_blocks: dtype torch.int8 is not allowed"),
        (lambda c: c.update({"layers.1.router.weight": torch.zeros(E, H + 1).bfloat16()}),
         r"layers.1.router.weight: checkpoint shape \[2, 65\] does not match the module's \[2, 64\]"),
        (lambda c: c.update({"layers.1.router.bias": torch.zeros(E, dtype=torch.int32)}),
         "layers.1.router.bias: checkpoint dtype torch.int32 cannot be copied into the module's torch.bfloat16"),
        (lambda c: c.update({"unknown.weight": torch.zeros(1)}),
         r"unknown.weight: the module has no parameter or buffer 'unknown.weight'"),
        (lambda c: c.update({"layers.0.experts.down_proj": torch.zeros(E, INTER, H).bfloat16()}),
         r"layers.0.experts.down_proj: given twice in the checkpoint \(layers.0.experts.down_proj, "),
        (lambda c: c.pop("layers.0.router.weight"),
         r"the checkpoint has no entry for 1 module tensor\(s\): 'layers.0.router.weight'"),
    ],
)
def test_bad_checkpoints_name_the_tensor(tmp_path, edit, match):
    ckpt = packed_checkpoint()
    edit(ckpt)
    save_file(ckpt, tmp_path / "bad.safetensors")
    _fails(MoE(), tmp_path / "bad.safetensors", match)


def test_target_shape_mismatch(ckpt_file):
    path, _ = ckpt_file
    model = MoE()
    model.layers[0].experts.down_proj = nn.Parameter(torch.zeros(E, INTER, H - 1, dtype=torch.bfloat16))
    _fails(model, path, r"layers.0.experts.down_proj: target shape \[2, 32, 63\] does not match")


def test_all_errors_are_listed_at_once(tmp_path):
    ckpt = packed_checkpoint()
    ckpt.pop("layers.1.experts.down_proj_scales")
    ckpt["layers.2.router.weight"] = torch.zeros(1)
    save_file(ckpt, tmp_path / "bad.safetensors")
    _fails(MoE(), tmp_path / "bad.safetensors", r"(?s)down_proj_blocks: has no matching.*layers.2.router.weight")


def test_truncated_file(ckpt_file):
    path, _ = ckpt_file
    last = max(read_safetensors_header(path).values(), key=lambda info: info.offset)
    os.truncate(path, path.stat().st_size - 10)
    _fails(MoE(), path, rf"tensor '{last.name}' in .* is truncated: its data ends at byte")
    os.truncate(path, 5)
    _fails(MoE(), path, "truncated safetensors file")


def test_bad_paths_and_meta_without_device(tmp_path, ckpt_file):
    path, _ = ckpt_file
    _fails(MoE(), tmp_path / "nope", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(MoE(), empty, r"holds no \*.safetensors file")
    (empty / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": "x.safetensors"}}))
    _fails(MoE(), empty, "tensor 'embed.weight': model.safetensors.index.json points to x.safetensors, which does")
    with torch.device("meta"):
        meta = MoE()
    with pytest.raises(ValueError, match=r"on the meta device \(.* are\); pass device=\.\.\. to create them"):
        load_mxfp4_into(meta, path)
    assert meta.embed.weight.is_meta
    with pytest.raises(ValueError, match=r"load_mxfp4_into\(rows_per_chunk=0\): must be an int >= 1 or None"):
        load_mxfp4_into(MoE(), path, rows_per_chunk=0)
    with pytest.raises(ValueError, match="device='meta' is not allowed"):
        load_mxfp4_into(meta, path, device="meta")
    with pytest.raises(ValueError, match="device='gpu0' is not a device string"):
        load_mxfp4_into(meta, path, device="gpu0")
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got dict"):
        load_mxfp4_into({}, path)


def test_duplicate_across_shards(tmp_path):
    save_file({"step": torch.tensor(1)}, tmp_path / "a.safetensors")
    save_file({"step": torch.tensor(2)}, tmp_path / "b.safetensors")
    _fails(MoE(), tmp_path, "tensor 'step' is in both a.safetensors and b.safetensors")


@pytest.mark.cuda
def test_cuda_model_from_cpu_file(ckpt_file):
    path, ckpt = ckpt_file
    model = MoE().cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    load_mxfp4_into(model, path, rows_per_chunk=ROWS)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    largest_plain = max(t.nbytes for n, t in ckpt.items() if "_blocks" not in n and "_scales" not in n)
    chunk = chunk_transient_bytes(ROWS, max(H, INTER) // 32, torch.bfloat16, moved=True)
    assert extra <= max(largest_plain, chunk) + 64 * 1024  # packed tensors stay on the CPU, chunks move
    assert_same_state(model.cpu(), expected_state(ckpt))
