"""--time-budget: the plan from the measured speed, planned again at half and four fifths of the budget from the
speed since the plan before, a tiny budget that stops on time with a checkpoint, and an interrupted budgeted run that
a rerun continues to the same plan and the same deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moco_retrieval.contracts.errors import ConfigError
from tests.conftest import ctrl_c_reaches_it, tiny_train_config
from moco_retrieval.trainer.checkpoint import load_checkpoint
from moco_retrieval.trainer.config import parse_duration
from moco_retrieval.trainer.schedule import TimeBudget
from moco_retrieval.trainer.train import train


def test_parse_duration__units_and_errors():
    assert (parse_duration("90s"), parse_duration("30m"), parse_duration("2h"), parse_duration("1.5h")) == (
        90,
        1800,
        7200,
        5400,
    )
    assert parse_duration("5") == 300  # a bare number is minutes
    for bad in ("soon", "-5m", "0s", "3 weeks"):
        with pytest.raises(ConfigError, match="time-budget"):
            parse_duration(bad)


def test_time_budget__plans_the_steps_that_fit_after_its_calibration_window():
    budget = TimeBudget(seconds=600, started=time.perf_counter())
    for _ in range(40):  # 2 untimed steps, then 0.5 s per step measured
        budget.record_step(0.5)
    # the window is min(60 s, 20% of the budget) = 60 s of timed steps: 38 x 0.5 = 19 s is not enough yet
    assert budget.seconds_per_step == pytest.approx(0.5) and not budget.calibration_due()
    budget = TimeBudget(seconds=600, started=time.perf_counter())
    for _ in range(130):
        budget.record_step(0.5)
    assert budget.calibration_due()
    total = budget.estimate_total(step=130, reserve_seconds=100)
    assert total == pytest.approx(130 + (600 - 100) / 0.5, abs=3)
    budget.total_steps = total
    assert not budget.should_stop(total - 1) and budget.should_stop(total)
    assert TimeBudget(seconds=10, spent=10.5).should_stop(0)  # earlier runs spent it all


def test_time_budget__plans_again_at_half_and_four_fifths_of_the_budget_from_the_speed_since():
    budget = TimeBudget(seconds=100, started=time.perf_counter() - 40)  # 40 s of the budget spent
    for _ in range(10):
        budget.record_step(0.5)
    assert not budget.replan_due()  # not planned yet: the first plan comes first
    budget.planned(200)
    assert not budget.replan_due()  # planned, 40% spent
    budget.started -= 15  # 55% spent
    assert not budget.replan_due()  # no step timed since the plan
    for _ in range(5):
        budget.record_step(1.0)  # the machine slowed down after the first plan
    assert budget.replan_due() and budget.seconds_per_step == pytest.approx(1.0)  # the speed since the plan
    budget.planned(150)
    assert budget.replans == 1 and budget.replanned_at == (0.5,) and not budget.replan_due()
    budget.started -= 20  # 75% spent
    for _ in range(5):
        budget.record_step(2.0)
    assert not budget.replan_due()
    budget.started -= 6  # 81% spent
    assert budget.replan_due() and budget.seconds_per_step == pytest.approx(2.0)
    budget.planned(120)
    budget.started -= 15  # 96% spent
    for _ in range(5):
        budget.record_step(2.0)
    assert budget.replanned_at == (0.5, 0.8) and not budget.replan_due()  # twice, no more
    resumed = TimeBudget.resumed(100, {"spent_seconds": 60, "total_steps": 200, "replans": 1})  # a rerun past half
    for _ in range(2 + 5):
        resumed.record_step(0.5)
    assert resumed.replans == 1 and not resumed.replan_due()  # re-planned at half; four fifths not reached
    resumed.started -= 25
    assert resumed.replan_due()
    saved = resumed.to_saved()
    assert (saved["total_steps"], saved["replans"]) == (200, 1) and saved["spent_seconds"] == pytest.approx(85, abs=1)


def test_time_budget__a_checkpoint_from_before_the_second_replan_resumes_with_its_one_replan():
    old = TimeBudget.resumed(100, {"spent_seconds": 85, "total_steps": 200, "replanned": True})
    assert (old.spent, old.total_steps, old.replans) == (85, 200, 1)
    for _ in range(2 + 5):
        old.record_step(0.5)
    assert old.replan_due()  # its second re-plan, at four fifths
    assert TimeBudget.resumed(100, {"spent_seconds": 30, "total_steps": 200, "replanned": False}).replans == 0
    assert TimeBudget.resumed(100, {}).replans == 0 and not TimeBudget.resumed(100, {}).calibrated


@pytest.mark.parametrize("batch, queue", [(8, 16), (48, 96)])  # 12 batches per epoch, and 2 (all at epoch starts)
def test_train__tiny_budget_stops_on_time_with_a_checkpoint(shapes_dir, tmp_path, batch, queue):
    cfg = tiny_train_config(
        shapes_dir, tmp_path / "run", epochs=None, time_budget="6s", batch_size=batch, queue_size=queue
    )
    result = train(cfg)
    ckpt = load_checkpoint(tmp_path / "run")
    assert result.stopped_by == "time budget" and ckpt["step"] == result.steps > 0
    assert ckpt["schedule"]["total_steps"] > 0  # planned from the measured speed
    assert ckpt["schedule"]["spent_seconds"] < 6 + 4  # on time: one step, the final evaluation and save after it
    assert "epochs" in ckpt["config"]["derived"] and ckpt["config"]["time_budget"] == "6s"
    assert ckpt["config"]["save_every"] == 10 and "save_every" in ckpt["config"]["derived"]  # set with the plan


def test_train__interrupted_budget_run_continues_to_the_same_plan(shapes_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "moco_retrieval",
        "train",
        str(shapes_dir),
        "--out",
        str(run),
        "--arch",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--queue-size",
        "16",
        "--time-budget",
        "20s",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--knn-every",
        "0",
        "--log-every",
        "1",
    ]
    # one thread: the run must make at least 5 steps between its re-plans at 10 and 16 s, and two threads
    # contending with other work for 2 cores ran 7 images/s (1.1 s a step), too few for the second re-plan
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=ctrl_c_reaches_it
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # interrupt once the plan is final: planned, then
        config = run / "config.json"  # planned again at 10 and 16 s
        if config.exists() and '"time_budget": "20s"' in config.read_text() and "50% and 80%" in config.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its second re-plan: too slow a machine for this test"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    first = load_checkpoint(run)
    planned = first["schedule"]["total_steps"]
    assert first["schedule"]["replans"] == 2 and first["config"]["derived"]["epochs"]["why"].count("re-planned") == 1
    assert planned > 0 and first["step"] < planned and first["schedule"]["spent_seconds"] < 20
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    final = load_checkpoint(run)
    assert final["schedule"]["total_steps"] == planned and final["schedule"]["replans"] == 2  # the same plan
    assert final["step"] > first["step"]
    assert final["step"] == planned or final["schedule"]["spent_seconds"] >= 20  # done, or out of time


def test_train__budget_spent_before_the_first_step_still_leaves_a_checkpoint(shapes_dir, tmp_path, monkeypatch):
    import moco_retrieval.trainer.train as train_module

    monkeypatch.setattr(train_module, "_out_of_time", lambda t, p: True)  # as if startup ate the whole budget
    cfg = tiny_train_config(shapes_dir, tmp_path / "run", epochs=None, time_budget="6s", batch_size=8, queue_size=16)
    result = train(cfg)
    assert result.stopped_by == "time budget" and result.steps == 0
    assert load_checkpoint(tmp_path / "run")["step"] == 0


def test_train__a_budget_spent_at_an_epoch_end_still_ends_with_the_final_knn(shapes_dir, tmp_path, monkeypatch):
    import json

    import moco_retrieval.trainer.train as train_module

    monkeypatch.setattr(train_module, "_out_of_time", lambda t, p: p.step >= t.steps_per_epoch)  # spent as epoch 1 ends
    cfg = tiny_train_config(
        shapes_dir, tmp_path / "run", epochs=None, time_budget="10m", batch_size=8, queue_size=16, knn_every=None
    )
    result = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("kind") == "epoch"][-1]
    assert result.stopped_by == "time budget" and result.epochs_done == 1
    assert result.knn_acc is not None and last["knn_acc"] == result.knn_acc  # the run's last row has its k-NN
