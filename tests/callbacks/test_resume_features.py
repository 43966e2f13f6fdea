"""A fit with the package's features (activation offload and the optimizer-state levers too), killed with SIGKILL
mid-training and resumed with ``ckpt_path="last"``, has the losses of the fit that never stopped, bitwise on CPU; a
checkpoint stays loadable when checkpointing or the fused loss is added on resume (the same math, to float32
rounding)."""

import json
import signal
from pathlib import Path

import pytest
import ranks
import resume_child

CHILD = Path(resume_child.__file__)


def _child(out, names, kill_at, mode):
    """``resume_child.py`` in a process of its own (forked by the test zygote: the imports are done once)."""
    return ranks.run([str(CHILD), str(out), names, str(kill_at), mode], timeout=240, PYTHONWARNINGS="ignore")


def _killed_and_resumed(tmp_path, names, kill_at=5):
    killed = _child(tmp_path, names, kill_at, "fit")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    seen = json.loads((tmp_path / "losses.json").read_text())
    assert len(seen) == kill_at  # the last checkpoint holds step kill_at - 1, an epoch's end (2 steps per epoch)
    resumed = _child(tmp_path, names, -1, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_levers_at_work(json.loads((tmp_path / "resumed.active.json").read_text()), names.split(","))
    return seen[: kill_at - 1] + json.loads((tmp_path / "resumed.json").read_text())


OPTIMIZER = {"in_backward": "InBackwardOptimizer", "host_optimizer": "HostOffloadOptimizer",
             "adamw8bit": "EightBitAdamW"}


def _assert_levers_at_work(active, names):
    """The resumed fit's last batch ran with the levers it was given (their losses alone could not tell: most keep
    the math bitwise). MemoryBudget may pull an optimizer lever of its own choice."""
    wanted = [OPTIMIZER[n] for n in names if n in OPTIMIZER]
    if wanted or "budget" not in names:
        assert active["optimizer"] == (wanted[0] if wanted else "AdamW"), active
    assert (active["offloaded_bytes"] > 0) == ("offload" in names), active


@pytest.mark.parametrize("names", [
    "qlora,checkpointing,fused,budget",
    pytest.param("checkpointing", marks=pytest.mark.slow),
    pytest.param("fused", marks=pytest.mark.slow),
    pytest.param("budget", marks=pytest.mark.slow),
    pytest.param("qlora", marks=pytest.mark.slow),  # in the fast suite within the first case
    pytest.param("offload", marks=pytest.mark.slow),
    pytest.param("in_backward", marks=pytest.mark.slow),
    pytest.param("host_optimizer", marks=pytest.mark.slow),
    pytest.param("adamw8bit", marks=pytest.mark.slow),
    pytest.param("qlora,checkpointing,offload,host_optimizer", marks=pytest.mark.slow),
    pytest.param("qlora,checkpointing,fused,tiled", marks=pytest.mark.slow),
])
def test_a_fit_killed_mid_training_resumes_with_the_uninterrupted_losses(tmp_path, names):
    stitched = _killed_and_resumed(tmp_path, names)
    straight = resume_child.fit(tmp_path / "straight", names)
    assert stitched == straight


def test_a_checkpoint_resumes_with_checkpointing_and_the_fused_loss_added(tmp_path):
    """Trained 2 steps without features (in this process: the resume, not the kill, is under test here), resumed
    with checkpointing and the fused loss."""
    seen = resume_child.fit(tmp_path, "-", steps=2)
    stitched = seen + resume_child.fit(tmp_path, "checkpointing,fused", resume=True)
    straight = resume_child.fit(tmp_path / "straight", "-")
    assert len(stitched) == len(straight) == resume_child.STEPS
    assert stitched != straight  # other roundings ...
    assert max(abs(a - b) for a, b in zip(stitched, straight)) < 1e-5  # ... of the same math
