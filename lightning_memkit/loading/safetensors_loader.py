"""Load an MXFP4 safetensors checkpoint into a module's parameters, one tensor at a time.

``load_mxfp4_into(module, path)`` reads a ``.safetensors`` file or a directory of them (with or without a
``*.safetensors.index.json``), maps ``X_blocks`` + ``X_scales`` to the module's ``X`` (dequantized in chunks
straight into the parameter) and copies every other tensor as it is. Memory during the load is the
module's own tensors plus the largest single entry being read (its packed bytes and one chunk of
temporaries), never the whole checkpoint.

Nothing is written before the whole manifest checks out: every file header is read and checked as
safetensors checks it (byte ranges against the file size, so empty and truncated files; tensors back to
back), every file is opened, every name is mapped, every shape and dtype is compared with its destination,
and every destination must be writable (no self-overlapping view; meta ones need a usable ``device``). A
failure is one ``ValueError`` listing each offending tensor, file or parameter.

Example::

    from lightning_memkit.loading import load_mxfp4_into
    with torch.device("meta"):
        model = MyMoE(config)                     # no memory yet
    load_mxfp4_into(model, "checkpoints/gpt-oss", device="cuda")
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lightning_memkit.loading.mxfp4 import check_mxfp4, check_writable, dequantize_mxfp4
from lightning_memkit.loading.stream import split_mxfp4_name
from lightning_memkit.memory.device import resolve_device
from lightning_memkit.validation import check_bool, check_int

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


def _plan(manifest: dict[str, TensorInfo], targets: dict[str, torch.Tensor], strict: bool,
          result: LoadResult) -> tuple[list[_Item], list[str]]:
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
    seen: dict[str, _Item] = {}
    for item in items:
        if item.target in seen:
            both = [s.name for s in seen[item.target].sources + item.sources]
            errors.append(f"{item.target}: given twice in the checkpoint ({', '.join(both)})")
        seen[item.target] = item
    planned: list[_Item] = []
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
            if item.mxfp4:
                blocks, scales = item.sources
                check_mxfp4(item.target, blocks.shape, blocks.dtype, scales.shape, scales.dtype, target.shape)
                if not target.dtype.is_floating_point:
                    raise ValueError(f"{item.target}: destination dtype {target.dtype} is not floating point")
            else:
                (src,) = item.sources
                if tuple(src.shape) != tuple(target.shape):
                    raise ValueError(f"{src.name}: checkpoint shape {list(src.shape)} does not match the module's "
                                     f"{list(target.shape)}")
                if _kind(src.dtype) != _kind(target.dtype):
                    raise ValueError(f"{src.name}: checkpoint dtype {src.dtype} cannot be copied into the module's "
                                     f"{target.dtype} (only within floating, integer or bool dtypes)")
        except ValueError as err:
            errors.append(str(err))
            continue
        planned.append(item)
    covered = {item.target for item in items}
    covered_ids = {id(targets[name]) for name in covered if name in targets}  # tied tensors count once
    absent = [name for name, t in targets.items() if name not in covered and id(t) not in covered_ids]
    if strict and absent:
        listed = ", ".join(repr(n) for n in absent[:_MAX_LISTED]) + (" ..." if len(absent) > _MAX_LISTED else "")
        errors.append(f"the checkpoint has no entry for {len(absent)} module tensor(s): {listed} "
                      "(pass strict=False to leave them as they are)")
    result.missing.extend(absent if not strict else [])
    planned.sort(key=lambda it: (str(it.sources[0].file), it.sources[0].offset))
    return planned, errors


def _locations(module: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every (submodule, store, name) holding each tensor object, so tied tensors stay tied."""
    locs: dict[int, list[tuple[nn.Module, str, str]]] = defaultdict(list)
    for sub in module.modules():
        for store in ("_parameters", "_buffers"):
            for name, t in getattr(sub, store).items():
                if t is not None:
                    locs[id(t)].append((sub, store, name))
    return locs


def _materialize(old: torch.Tensor, device: torch.device, locs) -> torch.Tensor:
    data = torch.empty(old.shape, dtype=old.dtype, device=device)
    new = nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else data
    for sub, store, name in locs.get(id(old), ()):
        getattr(sub, store)[name] = new
    return new


def _destination_errors(items: list[_Item], targets: dict[str, torch.Tensor], device) -> list[str]:
    """Every destination writable: dense (no self-overlap); meta ones only with a ``device`` that can hold them."""
    errors = []
    meta = [it.target for it in items if targets[it.target].device.type == "meta"]
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


def _open_files(stack: contextlib.ExitStack, items: list[_Item]) -> tuple[dict[Path, object], list[str]]:
    """Open every file the items read (safetensors validates each header) and check that it lists each source."""
    from safetensors import safe_open

    handles: dict[Path, object] = {}
    errors: list[str] = []
    for item in items:
        for info in item.sources:
            if info.file not in handles:
                try:
                    handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt"))
                except Exception as err:  # SafetensorError and OSError: name the file, whatever the reader says
                    handles[info.file] = None
                    errors.append(f"{info.file}: safetensors cannot open it ({type(err).__name__}: {err})")
            handle = handles[info.file]
            if handle is not None and info.name not in handle.keys():
                errors.append(f"tensor {info.name!r}: not found by safetensors in {info.file}")
    return handles, errors


def _progress(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


def load_mxfp4_into(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    rows_per_chunk: int | None = None,
    progress: bool = False,
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
            Tensors outside ``state_dict()`` (non-persistent buffers) are left as they are, even on meta.
        rows_per_chunk: see :func:`dequantize_mxfp4`.
        progress: show a rich progress bar (per tensor); progress is also logged at debug level.

    The peak during the load is what the module holds at the end plus the largest single entry being
    read (its bytes from the file, and for an MXFP4 pair one chunk of temporaries). Raises ``ValueError``
    before anything is written when any file, name, shape, dtype or destination does not fit.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    check_int(rows_per_chunk, "rows_per_chunk", minimum=1, allow_none=True, owner="load_mxfp4_into")
    check_bool(strict, "strict", owner="load_mxfp4_into")
    check_bool(progress, "progress", owner="load_mxfp4_into")
    if device is not None and str(device) == "meta":
        raise ValueError("device='meta' is not allowed: tensors must be materialized to be loaded")
    device = resolve_device(device) if device is not None else None

    started = time.perf_counter()
    try:
        manifest = checkpoint_manifest(path)
    except ValueError as err:
        raise ValueError(f"{err}; nothing was loaded") from None
    targets = module.state_dict(keep_vars=True)
    result = LoadResult()
    items, errors = _plan(manifest, targets, strict, result)
    errors += _destination_errors(items, targets, device)
    with contextlib.ExitStack() as stack:
        handles, open_errors = _open_files(stack, items)
        errors += open_errors
        if errors:
            lines = "\n".join(f"  - {e}" for e in errors)
            raise ValueError(f"checkpoint {str(path)!r} does not fit {type(module).__name__}; nothing was "
                             f"loaded:\n{lines}")
        _write(module, items, targets, handles, device, rows_per_chunk, progress, Path(path).name, result)
    log.info("loaded %d tensors (%d dequantized from MXFP4) from %s in %.1f s", len(result.loaded),
             len(result.dequantized), path, time.perf_counter() - started)
    return result


def _write(module, items, targets, handles, device, rows_per_chunk, progress, label, result: LoadResult) -> None:
    """Write every validated item (materializing meta destinations on ``device``, ties kept)."""
    meta = any(targets[it.target].device.type == "meta" for it in items)
    locs = _locations(module) if meta else {}
    replaced: dict[int, torch.Tensor] = {}
    with _progress(progress) as bar:
        task = bar.add_task(label, total=len(items)) if bar is not None else None
        for n, item in enumerate(items, 1):
            target = targets[item.target]
            if target.device.type == "meta":
                if id(target) not in replaced:
                    replaced[id(target)] = _materialize(target, device, locs)
                    result.materialized.append(item.target)
                target = replaced[id(target)]
            _write_one(item, target, handles, rows_per_chunk, result)
            log.debug("loaded %s (%d/%d)%s", item.target, n, len(items), " [MXFP4]" if item.mxfp4 else "")
            if bar is not None:
                bar.update(task, advance=1)


def _write_one(item: _Item, target: torch.Tensor, handles, rows_per_chunk, result: LoadResult) -> None:
    def read(info: TensorInfo) -> torch.Tensor:
        return handles[info.file].get_tensor(info.name)

    with torch.no_grad():
        if item.mxfp4:
            blocks, scales = read(item.sources[0]), read(item.sources[1])
            dequantize_mxfp4(blocks, scales, out=target, rows_per_chunk=rows_per_chunk)
            del blocks, scales
            result.dequantized.append(item.target)
        else:
            source = read(item.sources[0])
            target.copy_(source)
            del source
    result.loaded.append(item.target)
