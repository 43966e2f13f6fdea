"""Each recipe of examples/configs/recipes/ runs end to end on a tiny model saved here with a tokenizer trained here
(nothing downloaded): fit, its checkpoint resumed, its adapters exported (where it has them), the merged model
written by ``memkit export --merged`` and loaded by transformers."""

import json
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from lightning_memkit.cli.main import main  # noqa: E402
from lightning_memkit.demo.hf_models import tiny_hf_causal_lm  # noqa: E402
from lightning_memkit.finetune import train_tokenizer  # noqa: E402

RECIPES = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs" / "recipes").glob("*.yaml"))
FAMILY = {"qwen3_moe": "qwen3_moe"}


@pytest.mark.parametrize("recipe", [r if r.stem.startswith("llama3_2_1b") else pytest.param(r, marks=pytest.mark.slow)
                                    for r in RECIPES],
                         ids=[r.stem for r in RECIPES])  # the QLoRA recipes in the slow suite (10 s each)
def test_a_recipe_fits_resumes_and_exports_on_a_tiny_model(recipe, tmp_path, capsys):
    from transformers import AutoTokenizer

    docs = [f"line {i} of my own text, about {'cats' if i % 2 else 'boats'} and number {i}" for i in range(300)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer(docs, tmp_path / "tokenizer")
    family = next((f for key, f in FAMILY.items() if key in recipe.stem), "llama")
    vocab = len(AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer")))
    tiny_hf_causal_lm(family, seed=0, vocab_size=vocab).save_pretrained(tmp_path / "base")
    root = tmp_path / "run"
    args = ["fit", "--config", str(recipe), "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval",
            "1", "--trainer.limit_val_batches", "1", "--model.init_args.model", str(tmp_path / "base"),
            "--data.init_args.path", str(tmp_path / "docs.jsonl"), "--data.init_args.tokenizer",
            str(tmp_path / "tokenizer"), "--data.init_args.max_length", "32", "--data.init_args.batch_size", "2"]
    main([*args, "--trainer.max_steps", "2"])
    last = next(root.rglob("last.ckpt"))
    main([*args, "--trainer.max_steps", "3", "--ckpt_path", str(last)])
    out = capsys.readouterr().out
    assert "over 1 optimizer steps" in out  # the resumed run took step 3 only
    if "ExportAdapters" in recipe.read_text():
        exported = root / "adapters"
        meta = json.loads((exported / "memkit_base.json").read_text())
        assert meta["base_model_name_or_path"] == str(tmp_path / "base")
        assert (exported / "adapter_model.safetensors").is_file()
    main(["export", "--config", str(recipe), "--model.init_args.model", str(tmp_path / "base"), "--ckpt_path",
          str(next(root.rglob("last.ckpt"))), "--merged", "--output", str(tmp_path / "merged")])
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).config.vocab_size == vocab


def test_each_recipe_states_the_plans_its_benchmark_found():
    """A recipe's header says what `python -m benchmarks.run --only recipes` found for each `memkit estimate`
    command it names: the peak as given, and the first plan's peak, levers and step time (or that none fits)."""
    import sys

    repo = Path(__file__).resolve().parents[2]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from benchmarks.bench_recipes import header, planned_for

    entries = json.loads((repo / "benchmarks" / "results" / "recipes-cpu.json").read_text())["entries"]
    for recipe in RECIPES:
        said = header(recipe)
        for args in planned_for(recipe):
            label = f"{recipe.name} (memkit estimate {' '.join(args)})"
            entry = next((e for e in entries if e["case"].startswith(label)), None)
            assert entry is not None, f"no benchmark entry for {label}: run the recipes benchmark"
            rows = {r["impl"]: r for r in entry["rows"]}
            given = f"predicts {rows['the run as given']['device peak GiB']:.2f} GiB for the run as given"
            assert given in said, (recipe.name, given)
            if entry["met"]:
                first = rows["plan 1"]
                plan = (f"{first['device peak GiB']:.2f} GiB with {first['plan']} (step time "
                        f"{first['step time (predicted)']}, predicted)")
                assert plan in said, (recipe.name, plan)
            else:
                assert "finds no plan that fits" in said, recipe.name


SMALL = 400  # records, each a short line: fewer training batches per epoch than any recipe's validation interval


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A small data set (400 one-line records), a tokenizer trained on it, and a tiny model of each family the recipes
    train, saved as their checkpoints would be: ``{"docs": path, "tokenizer": path, family: path}``."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("small")
    docs = [f"record {i}: a short line about {'cats' if i % 2 else 'boats'}" for i in range(SMALL)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_tokenizer(docs, folder / "tokenizer")
    vocab = len(AutoTokenizer.from_pretrained(str(folder / "tokenizer")))
    out = {"docs": folder / "docs.jsonl", "tokenizer": folder / "tokenizer"}
    for family in ("llama", *FAMILY.values()):
        tiny_hf_causal_lm(family, seed=0, vocab_size=vocab).save_pretrained(folder / family)
        out[family] = folder / family
    return out


def _small_run(recipe: Path, small_data: dict) -> list[str]:
    """The overrides that point ``recipe`` at the small data set and the tiny model (blocks of 32 tokens, 4 a batch):
    nothing of the trainer's."""
    family = next((f for key, f in FAMILY.items() if key in recipe.stem), "llama")
    return ["--model.init_args.model", str(small_data[family]), "--data.init_args.path", str(small_data["docs"]),
            "--data.init_args.tokenizer", str(small_data["tokenizer"]), "--data.init_args.max_length", "32",
            "--data.init_args.batch_size", "4"]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_a_recipe_as_shipped_chooses_the_device_and_validates_on_a_small_data_set(recipe, small_data):
    """Unmodified, a recipe trains on the GPU where there is one and on the CPU here, and its validation interval
    holds for a data set of fewer batches per epoch than the interval (checked as Lightning checks it at fit start,
    after ``MemoryBudget`` planned: a recipe that failed it stopped minutes in)."""
    import torch
    from lightning.pytorch import Trainer

    from lightning_memkit.common.class_paths import instantiate
    from lightning_memkit.config.lightning_cli import parse_config
    from lightning_memkit.finetune import TextDataModule

    config = parse_config(recipe, _small_run(recipe, small_data))
    run = config["trainer"]
    trainer = Trainer(accelerator=run["accelerator"], devices=run["devices"], precision=run["precision"],
                      plugins=[instantiate(p) for p in run["plugins"] or []], logger=False)
    assert trainer.strategy.root_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    data = TextDataModule(**config["data"]["init_args"])
    data.setup("fit")
    batches = len(data.train_dataloader())
    interval, every = run["val_check_interval"], run["check_val_every_n_epoch"]
    assert 0 < batches < interval  # the small data set: the interval cannot count within one epoch
    if isinstance(interval, int):  # Lightning: `val_check_interval` must be <= the training batches, per epoch
        assert every is None or interval <= batches, (interval, every, batches)
    else:
        assert every is not None and 0 < interval <= 1, (interval, every)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])  # 3 to 5 s each
def test_a_recipe_as_shipped_fits_on_a_small_data_set_here(recipe, small_data, tmp_path, capsys):
    """``memkit fit`` of a recipe as shipped, on the small data set, for 2 steps: only where to write, the logger,
    the progress bar and ``max_steps`` given (no accelerator, no validation setting)."""
    main(["fit", "--config", str(recipe), *_small_run(recipe, small_data), "--trainer.default_root_dir",
          str(tmp_path / "run"), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.max_steps", "2"])
    assert "over 2 optimizer steps" in capsys.readouterr().out
    if "ExportAdapters" in recipe.read_text():
        assert (tmp_path / "run" / "adapters" / "adapter_model.safetensors").is_file()
