"""Recipes (trainer.recipes): what --recipe auto and --recipe paper choose for options left unset, and that every
choice is recorded with its reason."""

from __future__ import annotations

import pytest

from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.recipes import resolve_before_training, resolve_schedule
from moco_retrieval.trainer.variants import variant_for


def _resolve(num_images: int, total_steps: int | None = None, on_gpu: bool = False, **options) -> TrainConfig:
    cfg = TrainConfig(data_dir="d", out_dir="o", arch=options.pop("arch", "resnet18"), image_size=32, **options)
    variant = variant_for(cfg)
    cfg = resolve_before_training(cfg, variant, num_images, 1, on_gpu)
    steps = num_images // cfg.batch_size
    return resolve_schedule(cfg, variant, total_steps or (cfg.epochs or 200) * steps, steps)


def test_auto_v2_on_a_cpu__real_collection_recipe():
    cfg = _resolve(1600, total_steps=500)
    assert (cfg.batch_size, cfg.lr, cfg.queue_size, cfg.temperature) == (256, 0.06, 768, 0.2)  # K: half the images
    assert cfg.stem == "imagenet"  # on a CPU
    assert cfg.momentum == pytest.approx(0.99) and cfg.warmup_epochs == 0.0  # tau = 100 steps
    assert cfg.effective_lr == pytest.approx(0.06)
    for name in ("batch_size", "lr", "queue_size", "temperature", "momentum", "stem", "warmup_epochs", "epochs"):
        assert cfg.derived[name]["value"] == getattr(cfg, name) and cfg.derived[name]["why"], name
    assert TrainConfig.from_json(cfg.to_json()) == cfg  # the reasons travel with config.json


def test_auto_stem_on_a_cpu__small_for_the_narrow_resnet18_and_its_warning_unsaid(caplog):
    narrow = _resolve(1600, total_steps=500, arch="resnet18_narrow")
    assert narrow.stem == "small" and "keeps the resolution" in narrow.derived["stem"]["why"]
    assert "costs about 9x" not in caplog.text
    assert _resolve(1600, total_steps=500, arch="resnet18", stem="small").stem == "small"
    assert "costs about 9x" in caplog.text  # ResNet-18's own small stem is still 9x slower, and said so


def test_auto_v2__scales_with_data_and_run_length():
    large = _resolve(100_000, total_steps=100_000)
    assert (large.batch_size, large.momentum) == (256, pytest.approx(0.999))
    assert large.queue_size == 49920  # the paper's 65,536 capped at half the images, a multiple of the batch
    small = _resolve(100)  # at most half the images per batch, at least 32; the queue capped to fit
    assert (small.batch_size, small.queue_size, small.effective_lr) == (32, 32, pytest.approx(0.0075))
    big = _resolve(100_000, total_steps=100_000, on_gpu=True)
    assert big.batch_size == 256 and big.queue_size == 16384 and big.momentum == pytest.approx(0.999)
    assert big.effective_lr == pytest.approx(0.12)  # capped: 0.48 x 256/256 would be 4x the peak that learned
    gpu = _resolve(1600, on_gpu=True)
    assert (gpu.stem, gpu.batch_size, gpu.lr) == ("small", 32, 0.48)  # GPU: the small-batch recipe (demo data)
    assert _resolve(1600, batch_size=64).queue_size == 768  # a multiple of the user's batch
    assert _resolve(1600, batch_size=64, on_gpu=True).queue_size == 256


def test_auto_v3__lr_warmup_and_temperature():
    resnet = _resolve(1600, total_steps=800, moco_version=3)
    assert (resnet.lr, resnet.temperature, resnet.momentum) == (4.8, 0.2, 0.99)
    assert resnet.warmup_epochs == 1.0 and resnet.queue_size == 0
    short = _resolve(1600, total_steps=200, moco_version=3)
    assert short.warmup_epochs == pytest.approx(0.4)  # 1 epoch would be a quarter of the run: 10% instead
    vit = _resolve(1600, moco_version=3, arch="vit_tiny", batch_size=64)
    assert vit.lr == pytest.approx(3e-3) and vit.weight_decay == 0.1


def test_save_every__every_10_epochs_and_about_10_kept_in_longer_runs():
    steps = 1600 // 256  # 6 per epoch
    assert _resolve(1600, total_steps=100 * steps).save_every == 10  # 100 epochs: 10 kept, as always
    assert _resolve(1600, total_steps=101 * steps).save_every == 11  # past 100 epochs the interval grows
    long = _resolve(1600, total_steps=755 * steps)  # like the icons in 30 min (810 there: 81 x 138 MB kept before)
    assert long.save_every == 76 and "about 10 numbered checkpoints" in long.derived["save_every"]["why"]
    assert TrainConfig.from_json(long.to_json()) == long
    mine = _resolve(1600, total_steps=755 * steps, save_every=5)
    assert mine.save_every == 5 and "save_every" not in mine.derived


def test_paper__takes_the_published_values():
    v2 = _resolve(200_000, recipe="paper")
    assert (v2.batch_size, v2.lr, v2.queue_size, v2.momentum, v2.temperature) == (256, 0.03, 65536, 0.999, 0.2)
    assert v2.stem == "small"  # 32 px: the CIFAR stem, as before recipes existed
    v3 = _resolve(200_000, recipe="paper", moco_version=3, epochs=100)
    assert (v3.lr, v3.temperature, v3.warmup_epochs) == (0.6, 1.0, pytest.approx(10.0))


def test_user_values__are_never_overridden():
    cfg = _resolve(1600, batch_size=64, lr=0.1, temperature=0.5, queue_size=128, momentum=0.9, stem="small")
    assert (cfg.batch_size, cfg.lr, cfg.temperature, cfg.queue_size, cfg.momentum, cfg.stem) == (
        64,
        0.1,
        0.5,
        128,
        0.9,
        "small",
    )
    assert not {"batch_size", "lr", "temperature", "queue_size", "momentum", "stem"} & set(cfg.derived)


def test_recipe_table__help_and_reasons_state_the_tables_own_figures():
    from moco_retrieval.trainer import recipe_table as t
    from moco_retrieval.trainer.config import TrainConfig
    from moco_retrieval.trainer.recipes import resolve_before_training
    from moco_retrieval.trainer.variants import MoCoV3ViTVariant

    text = " ".join(t.describe().split())
    for figure in (
        f"{t.AUTO_BATCH_CPU_V2} (at most half",
        f"{t.AUTO_LR_CPU_V2:g} x batch/256",
        f"{t.AUTO_BATCH_CPU}",
        f"1/{t.AUTO_IMAGES_PER_BATCH} of the images",
        t.PAPER_BATCHES,
        f"{t.lr_multiple('v2'):g}x the paper's for v2",
        f"{t.lr_multiple('v3_vit'):g}x the paper's for v3 ViTs",
    ):
        assert figure in text, figure
    assert [round(t.lr_multiple(k), 6) for k in ("v2", "v3_resnet", "v3_vit")] == [16, 8, 20]
    cfg = TrainConfig(data_dir="d", out_dir="o", moco_version=3, arch="vit_tiny", image_size=32, batch_size=64)
    cfg = resolve_before_training(cfg, MoCoV3ViTVariant(), 1600, 1, on_gpu=False)
    assert "20x the paper's base lr" in cfg.derived["lr"]["why"]  # was "8x" for the ViT, whose lr is 20x
    assert MoCoV3ViTVariant.paper is t.PAPER["v3_vit"]  # one home for the paper values


def test_precision__fp32_on_a_cpu_bf16_on_a_gpu_unless_asked():
    import torch

    from moco_retrieval.trainer.config import CPU_FP32_WHY
    from moco_retrieval.trainer.device import resolve_amp

    assert resolve_amp(None, torch.device("cpu")) == (False, CPU_FP32_WHY)  # whatever the CPU's bf16 support
    assert resolve_amp(None, torch.device("cuda")) == (True, "GPU")
    assert resolve_amp(True, torch.device("cpu")) == (True, "--amp")
    assert resolve_amp(False, torch.device("cuda")) == (False, "--no-amp")
