"""One writer of the concurrent-writers test. Run by tests/reliability/test_checkpoint_writers.py.

    python _checkpoint_writer_worker.py DIR WRITER_ID SAVES GO_FILE OUT_JSON

Touches ``OUT_JSON`` with the suffix ``.ready`` once imported, waits for ``GO_FILE``, then saves ``SAVES``
times into ``DIR`` (``state_dict.w`` = ``1000 * WRITER_ID + step``, ``meta.writer`` = ``WRITER_ID``) and
writes how many saves succeeded and each error, by type and message.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from lightning_memkit.pipeline.checkpoint import CheckpointError, save_sharded


def main() -> None:
    directory, writer, saves, go, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), \
        Path(sys.argv[5])
    out.with_suffix(".ready").touch()  # imported: the test says go when both writers are
    while not go.exists():
        time.sleep(0.001)
    ok, errors = 0, []
    for step in range(1, saves + 1):
        state = {"state_dict": {"w": torch.full((256,), float(1000 * writer + step))}}
        try:
            save_sharded(directory, state, global_step=step, meta={"writer": writer})
            ok += 1
        except CheckpointError as err:
            errors.append(str(err))
        except Exception as err:  # noqa: BLE001 - anything else is a failure the test reports
            errors.append(f"UNEXPECTED {type(err).__name__}: {err}")
    out.write_text(json.dumps({"ok": ok, "errors": errors}))


if __name__ == "__main__":
    main()
