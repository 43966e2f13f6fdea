"""One process (gloo, world size 1) of tests/pipeline/test_partition_ties.py: DualPipeV over a toy LM whose head is
its input embedding, measured with ``LivePeak`` against the partition's prediction with and without ``ties``.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python _tie_peak_worker.py OUT_DIR
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _toy import lm_loss, toy_batch, toy_layers  # noqa: E402

from lightning_memkit.memory import LivePeak  # noqa: E402
from lightning_memkit.pipeline import measure_layer_costs, partition_layers  # noqa: E402
from lightning_memkit.pipeline.cost import shared_parameter_costs  # noqa: E402
from lightning_memkit.pipeline.runtime import PipelineRuntime  # noqa: E402

VOCAB, MICROBATCHES = 2048, 4


def tied_layers() -> torch.nn.ModuleList:
    layers = toy_layers(vocab=VOCAB, dim=32, blocks=4, plain_head=True)
    layers[-1].weight = layers[0].emb.weight  # the head is the input embedding
    return layers


def main() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=dt.timedelta(seconds=60))
    torch.set_num_threads(1)
    x, y = toy_batch(2 * MICROBATCHES, 32, vocab=VOCAB)
    layers = tied_layers()
    costs = measure_layer_costs(layers, x[:2], loss_fn=lm_loss, target=y[:2], optimizer="adamw")
    ties = shared_parameter_costs(layers, "adamw")
    plain = partition_layers(costs, 2, schedule="dualpipev", microbatches=MICROBATCHES)
    tied = partition_layers(costs, 2, schedule="dualpipev", microbatches=MICROBATCHES, ties=ties)
    del layers
    with LivePeak() as lp:
        layers = tied_layers()  # created inside: counted
        runtime = PipelineRuntime(layers, tied, loss_fn=lm_loss)
        opt = torch.optim.AdamW(runtime.parameters(), lr=1e-3, foreach=False)
        lp.reset_peak()
        for step in range(3):
            runtime.train_step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:
                lp.reset_peak()  # the first step also infers shapes: measure the steady state
    dist.destroy_process_group()
    result = {"plain": plain.predicted_peak_bytes[0], "tied": tied.predicted_peak_bytes[0], "measured": lp.peak_bytes,
              "tie_bytes": sum(c.static_bytes for *_, c in ties)}
    (Path(sys.argv[1]) / "tie_peak.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
