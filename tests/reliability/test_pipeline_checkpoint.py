"""Crash consistency of memkit_pipeline checkpoints: the on-disk format in one process, then crash injection on 2 ranks.

The old format (``rank_NNNNN.ckpt`` per rank overwritten in place, ``meta.json`` from rank 0 without a barrier,
no step, save id or checksum in the shards) fails every test here: an interrupted overwrite left shards of two
steps, or a truncated one, that loaded without a word (or with a bare unpickling error naming no file).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import ranks
import torch

from lightning_memkit.pipeline import checkpoint as ckpt
from lightning_memkit.pipeline.checkpoint import (
    MANIFEST,
    CheckpointError,
    load_shard,
    merge_state_dicts,
    new_save_id,
    read_manifest,
    save_sharded,
    verify_checkpoint,
)
from lightning_memkit.pipeline.writer_lock import LOCK_FILE

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_pipeline_crash_worker.py")
CRASH = 77  # exit code of a rank killed on purpose (as in the worker)
PHASES = ("before_shard", "mid_shard", "after_shards", "mid_manifest")


# -- helpers: 2 ranks as threads, with a barrier and an all-gather ----------------------------------------------
class Ranks:
    """``world`` ranks run as threads; once one has failed, a rank still waiting is released with an error."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots: list = [None] * world

    def barrier(self, name: str = "") -> None:
        self._barrier.wait()

    def all_gather_for(self, rank: int):
        def all_gather(obj):
            self._slots[rank] = obj
            self._barrier.wait()
            out = list(self._slots)
            self._barrier.wait()
            return out

        return all_gather

    def run(self, fn) -> list:
        results: list = [None] * self.world

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 - the error is the result
                results[rank] = err

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.5)
            if any(isinstance(r, BaseException) for r in results) and self._barrier.n_waiting:
                self._barrier.abort()  # a rank waits for one that failed: what a process group does, peer gone
        return results


def states_at(step: int, world: int = 2) -> list[dict]:
    """Each rank's state at ``step``: distinct weights per rank and step, plus Lightning-like loop state."""
    out = []
    for rank in range(world):
        g = torch.Generator().manual_seed(100 * step + rank)
        weights = {f"layers.{rank}.weight": torch.randn(64, 64, generator=g),
                   f"layers.{rank}.bias": torch.randn(64, generator=g)}
        out.append({"state_dict": weights, "global_step": step, "epoch": step // 4, "optimizer_states": [{"lr": 0.1}]})
    return out


def save(directory: Path, states: list[dict], step: int) -> list:
    """Save ``states`` (one per rank) as one checkpoint on ``len(states)`` thread ranks; the per-rank results."""
    group, save_id = Ranks(len(states)), new_save_id()
    return group.run(lambda rank: save_sharded(
        directory, states[rank], rank=rank, world_size=len(states), global_step=step, epoch=step // 4,
        save_id=save_id, meta={"sizes": [2, 2]}, barrier=group.barrier, all_gather=group.all_gather_for(rank),
    ))


def assert_holds(directory: Path, states: list[dict], step: int) -> None:
    """``directory`` loads as exactly ``states`` at ``step``, shard by shard and merged, and has no stray files."""
    manifest = verify_checkpoint(directory)
    assert (manifest["global_step"], manifest["epoch"], manifest["world_size"]) == (step, step // 4, len(states))
    merged = merge_state_dicts(directory)
    for rank, expected in enumerate(states):
        loaded = load_shard(directory, rank)
        assert loaded["global_step"] == step and loaded["optimizer_states"] == expected["optimizer_states"]
        for key, tensor in expected["state_dict"].items():
            assert torch.equal(loaded["state_dict"][key], tensor) and torch.equal(merged[key], tensor)


def files(directory: Path) -> list[str]:
    """The checkpoint's files (the writer lock of a standalone save lives in the directory too)."""
    return sorted(name for name in os.listdir(directory) if name != LOCK_FILE)


def committed_files(directory: Path) -> list[str]:
    return sorted([MANIFEST, *(s["file"] for s in read_manifest(directory)["shards"])])


def test_round_trip_and_overwrite_in_place(tmp_path):
    """Old code: overwriting reused rank_NNNNN.ckpt in place, so no save was ever isolated from the next."""
    d = tmp_path / "last.ckpt"
    assert not any(isinstance(r, BaseException) for r in save(d, states_at(2), step=2))
    assert_holds(d, states_at(2), step=2)
    first = committed_files(d)
    manifest = read_manifest(d)
    assert [s["rank"] for s in manifest["shards"]] == [0, 1] and manifest["meta"] == {"sizes": [2, 2]}
    assert all(s["bytes"] == (d / s["file"]).stat().st_size and len(s["sha256"]) == 64 for s in manifest["shards"])
    save(d, states_at(4), step=4)
    assert_holds(d, states_at(4), step=4)
    assert files(d) == committed_files(d) and not set(first) & set(files(d)) - {MANIFEST}  # A's shards are gone


def _truncate(d: Path, m: dict) -> str:
    f = d / m["shards"][1]["file"]
    f.write_bytes(f.read_bytes()[:-100])
    return str(f)


def _remove(d: Path, m: dict) -> str:
    (d / m["shards"][1]["file"]).unlink()
    return str(d / m["shards"][1]["file"])


def _flip(d: Path, m: dict) -> str:
    f = d / m["shards"][1]["file"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return str(f)


def _from_other_save(d: Path, m: dict) -> str:
    """Rank 1's listed file replaced by rank 1's shard of another save, with the manifest's size and hash updated."""
    other = d.parent / "other.ckpt"
    save(other, states_at(9), step=9)
    f = d / m["shards"][1]["file"]
    shutil.copyfile(other / read_manifest(other)["shards"][1]["file"], f)
    m["shards"][1].update(bytes=f.stat().st_size, sha256=ckpt._sha256(f))
    (d / MANIFEST).write_text(json.dumps(m))
    return str(f)


def _corrupt_manifest(d: Path, m: dict) -> str:
    (d / MANIFEST).write_text(json.dumps(m)[:-20])
    return str(d / MANIFEST)


def _empty_manifest(d: Path, m: dict) -> str:
    (d / MANIFEST).write_bytes(b"")
    return str(d / MANIFEST)


def _manifest_without_shards(d: Path, m: dict) -> str:
    (d / MANIFEST).write_text(json.dumps({**m, "shards": []}))
    return str(d / MANIFEST)


def _legacy(d: Path, m: dict) -> str:
    (d / MANIFEST).unlink()
    (d / "meta.json").write_text(json.dumps({"format": "memkit_pipeline", "version": 1, "world_size": 2}))
    return str(d / "meta.json")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "bytes where manifest.json lists"),
        (_remove, "missing shard of rank 1"),
        (_flip, "sha256 differs"),
        (_from_other_save, "a shard of another save"),
        (_corrupt_manifest, "unreadable manifest (JSONDecodeError"),
        (_empty_manifest, "unreadable manifest (JSONDecodeError"),
        (_manifest_without_shards, "corrupt manifest: lists ranks [] for world_size=2"),
        (_legacy, "format version 1 (meta.json, no manifest.json)"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, message):
    """Old code: these loaded silently (mixed, legacy) or failed inside torch.load without naming the file."""
    d = tmp_path / "last.ckpt"
    save(d, states_at(2), step=2)
    path = damage(d, read_manifest(d))
    for load in (merge_state_dicts, lambda p: load_shard(p, 1)):
        with pytest.raises(CheckpointError) as info:
            load(d)
        assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
        assert info.value.path == path and isinstance(info.value, ValueError)


def test_missing_directory_is_refused(tmp_path):
    """Old code: said only 'not a memkit_pipeline checkpoint' for a typo'd path, without the reason."""
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        read_manifest(tmp_path / "nope")


# -- interrupted saves -----------------------------------------------------------------------------------------
class Crash(Exception):
    """What the injected fault raises in ``raise`` mode."""


def inject(monkeypatch, phase: str, crash) -> None:
    """Call ``crash()`` at ``phase`` of the next save (rank 1's shard, or rank 0's manifest)."""
    if phase == "before_shard":
        write_shard = ckpt.write_shard

        def shard(directory, state, *, rank, **kwargs):
            if rank == 1:
                crash()
            return write_shard(directory, state, rank=rank, **kwargs)

        monkeypatch.setattr(ckpt, "write_shard", shard)
    elif phase == "after_shards":
        monkeypatch.setattr(ckpt, "write_manifest", lambda *args, **kwargs: crash())
    else:
        target = "rank_00001-" if phase == "mid_shard" else f".{MANIFEST}."
        write = ckpt._HashingWriter.write

        def partial(self, data):
            if target in self.file.name and (len(data) >= 1024 or phase == "mid_manifest"):
                write(self, bytes(data)[: len(data) // 2])  # some bytes of the file reach the disk
                self.flush()
                crash()
            return write(self, data)

        monkeypatch.setattr(ckpt._HashingWriter, "write", partial)


def _exit() -> None:
    os._exit(CRASH)


def _raise() -> None:
    raise Crash("injected fault")


def _save_in_a_child(directory: Path, states: list[dict], step: int) -> int:
    """Run the save in a forked process (a real crash: ``os._exit``, nothing cleaned up); its exit code."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=save, args=(directory, states, step))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
        pytest.fail("the interrupted save hung")
    return child.exitcode


@pytest.mark.parametrize("mode", ["raise", "exit"])
@pytest.mark.parametrize("phase", PHASES)
def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, phase, mode):
    """Old code: an interrupted overwrite left rank files of two steps (or a truncated one) behind one meta.json."""
    d = tmp_path / "last.ckpt"
    save(d, states_at(2), step=2)
    inject(monkeypatch, phase, _raise if mode == "raise" else _exit)
    if mode == "exit":
        assert _save_in_a_child(d, states_at(4), step=4) == CRASH
    else:
        results = save(d, states_at(4), step=4)
        assert all(isinstance(r, BaseException) for r in results), results  # no rank reports success
        if phase in ("before_shard", "mid_shard"):  # both ranks learn that rank 1's shard failed
            assert all("rank 1 failed to write its shard" in str(r) or "this rank failed" in str(r) for r in results)
    monkeypatch.undo()
    assert_holds(d, states_at(2), step=2)  # the previous save, bit for bit
    save(d, states_at(6), step=6)  # the next complete save commits and sweeps what the interrupted one left
    assert_holds(d, states_at(6), step=6)
    assert files(d) == committed_files(d)


def test_crash_after_the_commit_keeps_the_new_save_and_the_next_one_sweeps(tmp_path, monkeypatch):
    """Old code: had no commit point, so there was no 'after' in which the new save was known complete."""
    d = tmp_path / "last.ckpt"
    save(d, states_at(2), step=2)
    old = committed_files(d)
    monkeypatch.setattr(ckpt, "remove_stale", lambda *args: _raise())
    save(d, states_at(4), step=4)
    monkeypatch.undo()
    assert_holds(d, states_at(4), step=4)
    assert set(old) - {MANIFEST} <= set(files(d))  # A's shards are still there, unlisted
    save(d, states_at(6), step=6)
    assert files(d) == committed_files(d)


def test_saving_over_a_legacy_checkpoint_replaces_it(tmp_path):
    """Old code: a new save left old rank files next to new ones; now the old format's files go after the commit."""
    d = tmp_path / "last.ckpt"
    d.mkdir()
    for name in ("meta.json", "rank_00000.ckpt", "rank_00001.ckpt"):
        (d / name).write_text("old")
    (d / "README").write_text("not ours")
    save(d, states_at(2), step=2)
    assert files(d) == sorted([*committed_files(d), "README"])


# -- two gloo processes, one killed mid-save -------------------------------------------------------------------


def _launch(out: Path, *args: str) -> list[subprocess.Popen]:
    return ranks.launch(WORKER, [str(out), *args], 2)




@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "victim"),
    [("before_shard", 0), ("during_shard", 1), ("after_shard", 1), ("before_manifest", 0), ("during_manifest", 0)],
)
def test_rank_killed_while_overwriting_last_ckpt_resumes_from_the_previous_save(tmp_path, phase, victim):
    """Old code: the survivor's new shard sat next to the victim's old one, and the mix resumed with other losses."""
    done = ranks.wait(_launch(tmp_path, "crash", phase, str(victim)), 120)
    assert done[victim][0] == CRASH, done[victim][1][-3000:] + done[1 - victim][1][-3000:]
    for rc, out in ranks.wait(_launch(tmp_path, "resume"), 120):
        assert rc == 0, out[-4000:]
    crashed = json.loads((tmp_path / "crash_losses_rank0.json").read_text())
    for rank in range(2):
        r = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        assert r["ok"], r  # this format always keeps A: the other allowed outcome, a clear error, never happens
        assert r["train"] == r["reference_train"] and len(r["train"]) == 4  # resumed from A (step 2), bit for bit
        assert r["train"][:2] == crashed[2:4]  # and as the uninterrupted run went on from A before the crash
        assert r["weights_equal"] and r["files"] == r["listed"]  # same weights; the debris of B was swept
        corrupt = r["corrupt"]  # one flipped byte in rank 1's shard: every rank refuses, naming that file
        assert not corrupt["ok"] and corrupt["file"] in corrupt["error"] and "sha256 differs" in corrupt["error"]


def test_single_process_saves_resumes_and_merges(tmp_path):
    """Old code: wrote no manifest (the check fails); also pins that one process needs no group for barrier/gather."""
    done = ranks.run([WORKER, tmp_path, "single"], timeout=120, drop=("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "single.json").read_text())
    assert r["resumed"] == r["full"][4:] and len(r["full"]) == 6  # epoch 3 from the epoch-2 save, bit for bit
    assert r["merged_equal"] and r["manifest"]["world_size"] == 1 and r["manifest"]["global_step"] == 6
