"""Load an MXFP4 safetensors checkpoint into a module's parameters, one tensor at a time.

``load_mxfp4_into(module, path)`` reads a ``.safetensors`` file or a directory of them (with or without a
``*.safetensors.index.json``), maps ``X_blocks`` + ``X_scales`` to the module's ``X`` (dequantized in chunks
straight into the parameter) and copies every other tensor as it is. Memory during the load is the
module's own tensors plus the largest single entry being read (its packed bytes and one chunk of
temporaries), never the whole checkpoint. Each entry is read with plain file reads into a buffer that is
freed after use, not through a memory map whose touched pages would stay resident (and count in the
process's RSS) until the file is closed; :attr:`LoadResult.memory` reports the host RSS peak beside the
exact tensor bytes.

A module built on the meta device comes out with every parameter and buffer real: checkpoint entries are
created on ``device``, and non-persistent buffers (in no checkpoint) are recomputed by ``init_buffers``
(by default, for a module that is or holds a transformers model,
:func:`lightning_memkit.hf.meta_init.init_hf_buffers`). Anything that would stay on meta is an error.

Nothing is written before the whole manifest checks out: every file header is read and checked as
safetensors checks it (byte ranges against the file size, so empty and truncated files; tensors back to
back), every file is opened, every name is mapped, every shape and dtype is compared with its destination,
and every destination must be writable (no self-overlapping view; meta ones need a usable ``device``). A
failure is one ``ValueError`` listing each offending tensor, file or parameter.

Example::

    from lightning_memkit.loading import load_mxfp4_into
    with torch.device("meta"):
        model = MyMoE(config)                     # no memory yet
    result = load_mxfp4_into(model, "checkpoints/gpt-oss", device="cuda")
    print(result.memory)                          # host RSS peak and LivePeak tensor bytes
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_memkit.common.progress import WorkProgress
from lightning_memkit.common.validation import check_bool, check_int
from lightning_memkit.loading.meta_buffers import (
    BufferInit,
    initialize_meta_buffers,
    materialize,
    meta_buffer_names,
    meta_tensor_names,
    tensor_locations,
)
from lightning_memkit.loading.mxfp4 import check_mxfp4, check_writable, dequantize_mxfp4
from lightning_memkit.loading.stream import split_mxfp4_name
from lightning_memkit.measure.device import resolve_device
from lightning_memkit.measure.host_rss import HostRSS, MemoryReport
from lightning_memkit.measure.live_peak import LivePeak

__all__ = ["TensorInfo", "LoadResult", "read_safetensors_header", "checkpoint_manifest", "load_mxfp4_into"]

log = logging.getLogger("lightning_memkit")

_DTYPES = {
    code: getattr(torch, name)
    for code, name in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
        "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
        "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    }.items()
    if hasattr(torch, name)
}
_MAX_HEADER = 100 * 2**20
_MAX_LISTED = 12


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # first byte of the data in the file
    nbytes: int


@dataclass
class LoadResult:
    """What :func:`load_mxfp4_into` did (module names, in load order)."""

    loaded: list[str] = field(default_factory=list)
    dequantized: list[str] = field(default_factory=list)
    materialized: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # checkpoint entries without a destination (strict=False)
    missing: list[str] = field(default_factory=list)  # module entries absent from the checkpoint (strict=False)
    initialized: list[str] = field(default_factory=list)  # meta non-persistent buffers recomputed by init_buffers
    memory: MemoryReport | None = None  # host RSS and LivePeak tensor bytes of the whole call (measure=True)


def _read_header_json(path: Path, size: int) -> tuple[dict, int]:
    """The header object of a safetensors file and where its data starts; ``ValueError`` naming ``path``."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        header_len = int.from_bytes(raw, "little")
        if header_len > _MAX_HEADER or 8 + header_len > size:
            raise ValueError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes, "
                             f"file of {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: safetensors __metadata__ must map str to str, got {meta!r}")
    return header, 8 + header_len


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _tensor_info(path: Path, name: str, meta, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, non-negative int shape and offsets that hold exactly its bytes."""
    try:
        code, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        begin, end = offsets
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"tensor {name!r} in {path}: malformed header entry {meta!r}") from err
    if not isinstance(shape, list) or not all(map(_is_count, shape)) or not (_is_count(begin) and _is_count(end)):
        raise ValueError(f"tensor {name!r} in {path}: malformed header entry {meta!r} (shape and data_offsets "
                         "must be non-negative ints)")
    if code not in _DTYPES:
        raise ValueError(f"tensor {name!r} in {path}: dtype {code!r} is not supported; known: {sorted(_DTYPES)}")
    dtype = _DTYPES[code]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype, device="meta").element_size()
    if end - begin != nbytes:
        raise ValueError(f"tensor {name!r} in {path}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                         f"dtype {code} x shape {list(shape)} needs {nbytes}")
    if data_start + end > size:
        raise ValueError(f"tensor {name!r} in {path} is truncated: its data ends at byte {data_start + end}, "
                         f"the file has {size} bytes")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, nbytes)


def _check_layout(path: Path, infos: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """Tensors stored back to back from the data start to the end of the file, as safetensors requires."""
    at = data_start
    for info in sorted(infos.values(), key=lambda i: (i.offset, i.nbytes)):
        if info.offset != at:
            raise ValueError(f"tensor {info.name!r} in {path}: its data starts at byte {info.offset}, but the "
                             f"previous tensor ends at byte {at} (gap or overlap); not a valid safetensors file")
        at += info.nbytes
    if at != size:
        raise ValueError(f"{path}: the tensors' data ends at byte {at} but the file has {size} bytes "
                         "(trailing bytes); not a valid safetensors file")


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check it as safetensors does: every error names the file.

    Checks each tensor's dtype, shape and byte range against the file size (empty and truncated files),
    and that the tensors fill the data section back to back.
    """
    path = Path(path)
    size = path.stat().st_size
    header, data_start = _read_header_json(path, size)
    infos = {name: _tensor_info(path, name, meta, data_start, size)
             for name, meta in header.items() if name != "__metadata__"}
    _check_layout(path, infos, data_start, size)
    return infos


def checkpoint_manifest(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors file or directory (index json if present, else every ``*.safetensors``)."""
    path = Path(path)
    if path.is_file():
        return read_safetensors_header(path)
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r} does not exist; expected a .safetensors file or a directory of them")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        index = path / "model.safetensors.index.json" if (path / "model.safetensors.index.json").exists() \
            else indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object)") from err
        headers: dict[str, dict[str, TensorInfo]] = {}
        manifest: dict[str, TensorInfo] = {}
        for name, file in weight_map.items():
            shard = path / file
            if file not in headers:
                if not shard.is_file():
                    raise ValueError(f"tensor {name!r}: {index.name} points to {file}, which does not exist")
                headers[file] = read_safetensors_header(shard)
            if name not in headers[file]:
                raise ValueError(f"tensor {name!r}: {index.name} points to {file}, whose header does not list it")
            manifest[name] = headers[file][name]
        return manifest
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path={str(path)!r} holds no *.safetensors file")
    manifest = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name in manifest:
                raise ValueError(f"tensor {name!r} is in both {manifest[name].file.name} and {file.name}")
            manifest[name] = info
    return manifest


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


@dataclass
class _Item:
    target: str
    sources: tuple[TensorInfo, ...]  # (blocks, scales) or (tensor,)

    @property
    def mxfp4(self) -> bool:
        return len(self.sources) == 2


def _group_items(manifest: dict[str, TensorInfo]) -> tuple[list[_Item], list[str]]:
    """One item per plain tensor, then one per ``X_blocks`` + ``X_scales`` pair; an unpaired half is an error."""
    items: list[_Item] = []
    errors: list[str] = []
    pairs: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in manifest.items():
        base, suffix = split_mxfp4_name(name)
        if suffix is None:
            items.append(_Item(name, (info,)))
        else:
            pairs[base][suffix] = info
    for base, pair in pairs.items():
        if len(pair) == 1:
            (suffix, info), = pair.items()
            other = "_scales" if suffix == "_blocks" else "_blocks"
            errors.append(f"{info.name}: has no matching {base}{other} in the checkpoint")
            continue
        items.append(_Item(base, (pair["_blocks"], pair["_scales"])))
    return items, errors


def _duplicate_errors(items: list[_Item]) -> list[str]:
    """One error per item whose target an earlier item already fills."""
    errors: list[str] = []
    seen: dict[str, _Item] = {}
    for item in items:
        if item.target in seen:
            both = [s.name for s in seen[item.target].sources + item.sources]
            errors.append(f"{item.target}: given twice in the checkpoint ({', '.join(both)})")
        seen[item.target] = item
    return errors


def _check_item(item: _Item, target: torch.Tensor) -> None:
    """``ValueError`` unless ``item``'s sources fit ``target``: MXFP4 layout and a floating destination, or the
    same shape and kind of dtype."""
    if item.mxfp4:
        blocks, scales = item.sources
        check_mxfp4(item.target, blocks.shape, blocks.dtype, scales.shape, scales.dtype, target.shape)
        if not target.dtype.is_floating_point:
            raise ValueError(f"{item.target}: destination dtype {target.dtype} is not floating point")
        return
    (src,) = item.sources
    if tuple(src.shape) != tuple(target.shape):
        raise ValueError(f"{src.name}: checkpoint shape {list(src.shape)} does not match the module's "
                         f"{list(target.shape)}")
    if _kind(src.dtype) != _kind(target.dtype):
        raise ValueError(f"{src.name}: checkpoint dtype {src.dtype} cannot be copied into the module's "
                         f"{target.dtype} (only within floating, integer or bool dtypes)")


def _match_items(items: list[_Item], targets: dict[str, torch.Tensor], strict: bool,
                 result: LoadResult) -> tuple[list[_Item], list[str]]:
    """The items with a fitting destination; the others are errors (or ``result.ignored`` when not ``strict``
    and the module has no such tensor)."""
    planned: list[_Item] = []
    errors: list[str] = []
    for item in items:
        target = targets.get(item.target)
        if target is None:
            if strict:
                names = " + ".join(s.name for s in item.sources)
                errors.append(f"{names}: the module has no parameter or buffer {item.target!r}")
            else:
                result.ignored.extend(s.name for s in item.sources)
            continue
        try:
            _check_item(item, target)
        except ValueError as err:
            errors.append(str(err))
            continue
        planned.append(item)
    return planned, errors


def _absent_targets(items: list[_Item], targets: dict[str, torch.Tensor]) -> list[str]:
    """Module tensors that no item fills (tied tensors count once)."""
    covered = {item.target for item in items}
    covered_ids = {id(targets[name]) for name in covered if name in targets}
    return [name for name, t in targets.items() if name not in covered and id(t) not in covered_ids]


def _plan(manifest: dict[str, TensorInfo], targets: dict[str, torch.Tensor], strict: bool,
          result: LoadResult) -> tuple[list[_Item], list[str]]:
    """The items to load, in file order, and every error; ``strict=False`` fills ``result.ignored``/``missing``."""
    items, errors = _group_items(manifest)
    errors += _duplicate_errors(items)
    planned, mismatches = _match_items(items, targets, strict, result)
    errors += mismatches
    absent = _absent_targets(items, targets)
    if strict and absent:
        listed = ", ".join(repr(n) for n in absent[:_MAX_LISTED]) + (" ..." if len(absent) > _MAX_LISTED else "")
        errors.append(f"the checkpoint has no entry for {len(absent)} module tensor(s): {listed} "
                      "(pass strict=False to leave them as they are)")
    result.missing.extend(absent if not strict else [])
    planned.sort(key=lambda it: (str(it.sources[0].file), it.sources[0].offset))
    return planned, errors


def _destination_errors(items: list[_Item], targets: dict[str, torch.Tensor], device, buffers: list[str]) -> list[str]:
    """Every destination writable: dense (no self-overlap); meta ones only with a ``device`` that can hold them."""
    errors = []
    meta = [it.target for it in items if targets[it.target].device.type == "meta"] + buffers
    for item in items:
        if targets[item.target].device.type != "meta":
            try:
                check_writable(item.target, targets[item.target])
            except ValueError as err:
                errors.append(str(err))
    if meta and device is None:
        errors.append(f"{meta[0]}: on the meta device ({len(meta)} tensor(s) are); pass device=... to create them")
    elif meta:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as err:  # AssertionError: torch built without CUDA
            errors.append(f"device={str(device)!r}: cannot create the {len(meta)} meta tensor(s) there ({err})")
    return errors


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_MAX_LISTED]) + (f" ... ({len(names)} in all)" if len(names) > _MAX_LISTED else "")


def _leftover_errors(module: nn.Module, result: LoadResult, targets: dict[str, torch.Tensor],
                     init_buffers: BufferInit | None) -> tuple[list[str], list[str]]:
    """Meta tensors no checkpoint entry fills: ``(non-persistent buffers to recompute, errors)``."""
    skipped = [name for name in result.missing if targets[name].is_meta]  # strict=False: absent from the checkpoint
    buffers = meta_buffer_names(module)
    errors = []
    if skipped:
        errors.append(f"{_listed(skipped)}: on the meta device with no checkpoint entry, so it would stay there")
    if buffers and init_buffers is None:
        errors.append(f"{_listed(buffers)}: non-persistent buffer(s) on the meta device, which no checkpoint holds; "
                      "pass init_buffers=fn(module, names) to recompute them (a transformers model gets "
                      "lightning_memkit.hf.meta_init.init_hf_buffers by default)")
    return buffers, errors


def _check_files(items: list[_Item]) -> list[str]:
    """Open every file the items read with safetensors (which validates each header) and check it lists each source."""
    from safetensors import safe_open

    errors: list[str] = []
    if sys.byteorder != "little":
        errors.append(f"this machine is {sys.byteorder}-endian; safetensors files are little-endian")
    sources: dict[Path, list[str]] = defaultdict(list)
    for item in items:
        for info in item.sources:
            sources[info.file].append(info.name)
    for file, names in sources.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                keys = set(handle.keys())
        except Exception as err:  # SafetensorError and OSError: name the file, whatever the reader says
            errors.append(f"{file}: safetensors cannot open it ({type(err).__name__}: {err})")
            continue
        errors += [f"tensor {name!r}: not found by safetensors in {file}" for name in names if name not in keys]
    return errors


class _Reader:
    """Reads tensors with plain file reads into fresh CPU buffers: no memory map, nothing resident after use."""

    def __init__(self, stack: contextlib.ExitStack):
        self._stack = stack
        self._files: dict[Path, object] = {}

    def read(self, info: TensorInfo) -> torch.Tensor:
        f = self._files.get(info.file)
        if f is None:
            f = self._files[info.file] = self._stack.enter_context(open(info.file, "rb", buffering=0))
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            view = memoryview((ctypes.c_char * info.nbytes).from_address(buf.data_ptr())).cast("B")
            f.seek(info.offset)
            done = 0
            while done < info.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"tensor {info.name!r} in {info.file}: the file ended after {done} of "
                                     f"{info.nbytes} bytes (changed during the load?)")
                done += n
        return buf.view(info.dtype).reshape(info.shape)


def _check_args(module, path, strict, device, rows_per_chunk, progress, init_buffers, measure) -> torch.device | None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    check_int(rows_per_chunk, "rows_per_chunk", minimum=1, allow_none=True, owner="load_mxfp4_into")
    check_bool(strict, "strict", owner="load_mxfp4_into")
    check_bool(progress, "progress", owner="load_mxfp4_into")
    check_bool(measure, "measure", owner="load_mxfp4_into")
    if init_buffers is not None and not callable(init_buffers):
        raise TypeError(f"load_mxfp4_into(init_buffers=...) must be a callable (module, names) or None, "
                        f"got {type(init_buffers).__name__}")
    if device is not None and str(device) == "meta":
        raise ValueError("device='meta' is not allowed: tensors must be materialized to be loaded")
    return resolve_device(device) if device is not None else None


def load_mxfp4_into(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    rows_per_chunk: int | None = None,
    progress: bool = False,
    init_buffers: BufferInit | None = None,
    measure: bool = True,
) -> LoadResult:
    """Copy a (MXFP4) safetensors checkpoint into ``module``'s existing parameters and buffers.

    Args:
        module: destination; names follow ``module.state_dict()``. ``X_blocks`` + ``X_scales`` fill ``X``
            (dequantized to ``X``'s dtype, layout of :func:`dequantize_mxfp4`); other entries are copied
            (cast within floating / integer dtypes).
        path: a ``.safetensors`` file, or a directory with ``*.safetensors`` shards and optionally an index.
        strict: every checkpoint entry must have a destination and every module entry a source.
        device: where to create tensors that are on the meta device (required if there are any); a tied
            meta parameter is created once and stays tied. Others are written in place, on their device.
        rows_per_chunk: see :func:`dequantize_mxfp4`.
        progress: log one info line per tensor written (:class:`~lightning_memkit.common.progress.WorkProgress`);
            each tensor is also logged at debug level.
        init_buffers: ``init_buffers(module, names)`` fills the non-persistent buffers ``names`` (in no
            checkpoint) that were on meta, after they were allocated on ``device``. It runs before any
            checkpoint entry is written; if it raises, or leaves one of them unwritten, they go back to meta and
            nothing is loaded. ``None`` (default): :func:`lightning_memkit.hf.meta_init.init_hf_buffers` when
            ``module`` is or holds a transformers model; any other module with such buffers is refused, naming
            them, until it is given.
        measure: record the host RSS peak and the LivePeak tensor bytes of the call in ``result.memory``.

    The peak during the load is what the module holds at the end plus the largest single entry being
    read (its bytes from the file, and for an MXFP4 pair one chunk of temporaries). Raises ``ValueError``
    before anything is written when any file, name, shape, dtype or destination does not fit, or when a
    tensor would stay on the meta device.
    """
    device = _check_args(module, path, strict, device, rows_per_chunk, progress, init_buffers, measure)
    if init_buffers is None:
        from lightning_memkit.hf.meta_init import default_buffer_init

        init_buffers = default_buffer_init(module)
    started = time.perf_counter()
    live, rss = (LivePeak(), HostRSS()) if measure else (contextlib.nullcontext(), contextlib.nullcontext())
    with live, rss:
        result = _load(module, path, strict, device, rows_per_chunk, progress, init_buffers)
    if measure:
        result.memory = MemoryReport.of(live, rss)
    log.info("loaded %d tensors (%d dequantized from MXFP4) from %s in %.1f s%s", len(result.loaded),
             len(result.dequantized), path, time.perf_counter() - started,
             f"; {result.memory}" if result.memory is not None else "")
    return result


def _load(module, path, strict, device, rows_per_chunk, progress, init_buffers) -> LoadResult:
    try:
        manifest = checkpoint_manifest(path)
    except ValueError as err:
        raise ValueError(f"{err}; nothing was loaded") from None
    targets = module.state_dict(keep_vars=True)
    result = LoadResult()
    items, errors = _plan(manifest, targets, strict, result)
    buffers, leftover = _leftover_errors(module, result, targets, init_buffers)
    errors += leftover + _destination_errors(items, targets, device, buffers) + _check_files(items)
    if errors:
        lines = "\n".join(f"  - {e}" for e in errors)
        raise ValueError(f"checkpoint {str(path)!r} does not fit {type(module).__name__}; nothing was loaded:\n{lines}")
    try:
        initialize_meta_buffers(module, buffers, device, init_buffers)
    except ValueError as err:
        raise ValueError(f"{err}; nothing was loaded") from err
    result.initialized.extend(buffers)
    with contextlib.ExitStack() as stack:
        _write(module, items, targets, _Reader(stack), device, rows_per_chunk, progress, Path(path).name, result)
    still = meta_tensor_names(module)
    if still:  # only if the module changed under the load (validation covers every meta tensor)
        raise ValueError(f"{_listed(still)}: still on the meta device after the load")
    return result


def _write(module, items, targets, reader: _Reader, device, rows_per_chunk, progress, label, result) -> None:
    """Write every validated item (materializing meta destinations on ``device``, ties kept)."""
    meta = any(targets[it.target].device.type == "meta" for it in items)
    locs = tensor_locations(module) if meta else {}
    replaced: dict[int, torch.Tensor] = {}
    bar = WorkProgress(f"loading {label}", total=len(items), enabled=progress)
    for n, item in enumerate(items, 1):
        target = targets[item.target]
        if target.device.type == "meta":
            if id(target) not in replaced:
                replaced[id(target)] = materialize(target, device, locs)
                result.materialized.append(item.target)
            target = replaced[id(target)]
        _write_one(item, target, reader, rows_per_chunk, result)
        log.debug("loaded %s (%d/%d)%s", item.target, n, len(items), " [MXFP4]" if item.mxfp4 else "")
        bar.step(item.target + (" [MXFP4]" if item.mxfp4 else ""))


def _write_one(item: _Item, target: torch.Tensor, reader: _Reader, rows_per_chunk, result: LoadResult) -> None:
    with torch.no_grad():
        if item.mxfp4:
            blocks, scales = reader.read(item.sources[0]), reader.read(item.sources[1])
            dequantize_mxfp4(blocks, scales, out=target, rows_per_chunk=rows_per_chunk)
            del blocks, scales
            result.dequantized.append(item.target)
        else:
            source = reader.read(item.sources[0])
            target.copy_(source)
            del source
    result.loaded.append(item.target)
