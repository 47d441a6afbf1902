"""--arch auto and --image-size auto: the network from the device, the training size from the images' own sizes.

A new user's ``moco train DIR --out R`` used to train ResNet-50 at 224 px everywhere, upscaling 28-px images 8x
(issue 19). These tests hold the survey, the rules at their boundaries, what config.json records, and that the
identical command resumes (including runs made before auto existed, which saved resnet50 at 224 px).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moco_retrieval.trainer import recipe_table as table
from moco_retrieval.trainer.checkpoint import load_checkpoint
from moco_retrieval.trainer.config import TrainConfig
from moco_retrieval.trainer.demo_data import write_demo_dataset
from moco_retrieval.trainer.image_survey import ImageSurvey, evenly_spread, survey_images
from moco_retrieval.trainer.recipes import resolve_model_and_size
from moco_retrieval.trainer.train import train
from moco_retrieval.contracts.images import walk_image_files


def _survey(side: int) -> ImageSurvey:
    return ImageSurvey(sampled=10, median_side=side, min_side=side, max_side=side)


def _config(**values) -> TrainConfig:
    return TrainConfig(data_dir="d", out_dir="o", **values)


def test_survey__median_shorter_side_of_the_headers_and_unreadable_files_passed_over(tmp_path):
    write_demo_dataset(tmp_path / "a", per_class=3, size=20, seed=0, classes=("circle", "square"))
    write_demo_dataset(tmp_path / "a", per_class=2, size=48, seed=0, classes=("triangle",))
    (tmp_path / "a" / "circle" / "broken.png").write_bytes(b"not a png")
    files = walk_image_files(tmp_path / "a")
    survey = survey_images(tmp_path / "a", files)
    assert (survey.sampled, survey.median_side, survey.min_side, survey.max_side) == (8, 20, 20, 48)
    assert survey_images(tmp_path / "a", [f for f in files if f.path.endswith("broken.png")]) is None


def test_survey__samples_a_fixed_even_spread_of_large_folders():
    items = list(range(10_000))
    picked = evenly_spread(items, 1000)
    assert len(picked) == 1000 and picked[0] == 0 and picked[-1] == 9_999
    assert picked == evenly_spread(items, 1000)
    assert evenly_spread(items[:7], 1000) == items[:7]


@pytest.mark.parametrize(
    "median, on_gpu, expected",
    [(8, False, 28), (27, False, 28), (28, False, 28), (31, False, 31), (32, False, 32), (33, False, 32)]
    + [(900, False, 32)]
    + [(8, True, 32), (28, True, 32), (32, True, 32), (33, True, 48), (100, True, 112), (224, True, 224)]
    + [(900, True, 224)],
)
def test_image_size_rule__rounds_the_median_side_up_within_the_devices_range(median, on_gpu, expected):
    cfg = resolve_model_and_size(_config(), _survey(median), 1000, 1, on_gpu)
    assert cfg.image_size == expected
    assert f"median shorter side {median} px" in cfg.derived["image_size"]["why"]
    assert ("lost to it in 4-minute runs" in cfg.derived["image_size"]["why"]) is (not on_gpu and expected == 32)
    assert ("at their own size" in cfg.derived["image_size"]["why"]) is (not on_gpu and expected < 32)


def test_image_size_rule__images_under_32_px_keep_their_size_for_moco_v2_on_a_cpu_only():
    """The native size was measured for MoCo v2 on a CPU (Fashion-MNIST, 28 px); v3 and the papers' recipe keep
    their sizes."""
    v3 = resolve_model_and_size(_config(moco_version=3, arch="resnet18"), _survey(28), 1000, 1, False)
    paper = resolve_model_and_size(_config(recipe="paper"), _survey(28), 1000, 1, False)
    assert (v3.image_size, paper.image_size) == (32, table.PAPER_IMAGE_SIZE)


def test_arch_rule__resnet18_on_a_cpu_resnet50_on_a_gpu_and_the_papers_values_one_flag_away():
    cpu = resolve_model_and_size(_config(), _survey(28), 1000, 1, on_gpu=False)
    gpu = resolve_model_and_size(_config(), _survey(28), 1000, 8, on_gpu=True)
    paper = resolve_model_and_size(_config(recipe="paper"), _survey(28), 1000, 1, on_gpu=False)
    assert (cpu.arch, gpu.arch, paper.arch) == (table.AUTO_ARCH_CPU, table.AUTO_ARCH_GPU, table.PAPER_ARCH)
    assert (cpu.arch, paper.image_size) == ("resnet18", 224)
    assert cpu.derived["arch"] == {"value": "resnet18", "why": cpu.derived["arch"]["why"], "requested": "auto"}


def test_rules__keep_what_the_user_set_and_v3_vits_keep_their_arch():
    cfg = resolve_model_and_size(_config(arch="resnet34", image_size=96), _survey(28), 1000, 1, False)
    assert (cfg.arch, cfg.image_size, cfg.derived) == ("resnet34", 96, {})
    vit = resolve_model_and_size(_config(moco_version=3, arch="vit_tiny"), _survey(28), 1000, 1, False)
    assert (vit.arch, vit.image_size) == ("vit_tiny", 32)


def test_rules__without_a_survey_take_the_devices_largest_size():
    assert resolve_model_and_size(_config(), None, 1000, 1, False).image_size == table.SIDE_RANGE_CPU[1]


def test_help__states_the_auto_arch_and_size():
    text = " ".join(table.describe().split())
    assert f"on a CPU: {table.AUTO_ARCH_CPU}" in text
    assert f"on a CPU: {table.SIDE_RANGE_CPU[0]} px; on a GPU: the images' median shorter side" in text


@pytest.fixture(scope="module")
def small_images(tmp_path_factory) -> Path:
    """8 classes x 8 generated shapes of 20 px (64 images): a folder of images smaller than any training size."""
    return write_demo_dataset(tmp_path_factory.mktemp("small") / "data", per_class=8, size=20, seed=2)


def _defaults_config(data: Path, out: Path) -> TrainConfig:
    """What ``moco train DATA --out OUT --epochs 2 --batch-size 16`` gives on a CPU (arch and size left auto)."""
    return TrainConfig(
        data_dir=str(data), out_dir=str(out), epochs=2, batch_size=16, workers=0, device="cpu", knn_every=0
    )


def test_train__defaults_pick_resnet18_at_the_images_size_record_why_and_the_same_command_resumes(
    small_images, tmp_path
):
    cfg = _defaults_config(small_images, tmp_path / "run")
    first = train(cfg, stop_at_epoch=1)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["arch"], saved["image_size"]) == ("resnet18", table.NATIVE_FLOOR_CPU_V2)  # 20 px: upscaled to 28
    assert saved["extra"]["image_survey"]["median_side"] == 20
    assert "median shorter side 20 px" in saved["derived"]["image_size"]["why"]
    assert "CPU" in saved["derived"]["arch"]["why"]
    resumed = train(cfg)  # the identical command: resumes, never re-derives, never refuses
    assert resumed.steps == 2 * first.steps
    assert load_checkpoint(tmp_path / "run")["config"]["image_size"] == table.NATIVE_FLOOR_CPU_V2


def test_train__a_run_saved_before_auto_resumes_with_its_own_network_and_size(small_images, tmp_path):
    """Runs made when the defaults were ResNet-50 at 224 px saved those values with no derived entry: the same
    default command must resume them as they were, not re-derive another network (a ResNet-34 at 48 px stands
    in for them here, cheaper on a CPU)."""
    old = _defaults_config(small_images, tmp_path / "run").replace(arch="resnet34", image_size=48)
    first = train(old, stop_at_epoch=1)
    assert "arch" not in load_checkpoint(tmp_path / "run")["config"]["derived"]
    resumed = train(_defaults_config(small_images, tmp_path / "run"))
    config = load_checkpoint(tmp_path / "run")["config"]
    assert (config["arch"], config["image_size"]) == ("resnet34", 48) and resumed.steps == 2 * first.steps
