"""The run's schedules over optimizer steps, and the time budget that sets how many steps there are.

:class:`Schedule`: linear learning-rate warm-up, then a half cosine to 0 at ``total_steps``; the key-encoder
momentum as the variant defines it over the same progress. In ``--epochs`` mode the total is known up front;
with ``--time-budget`` it is set by :class:`TimeBudget` from the throughput measured in the first minute, and set
again at half and at four fifths of the budget, each time from the throughput measured since the plan before (the
first minute's speed can be off either way: a 600 s run finished 14% early, a 12-minute one ran out of time 7%
short of its plan; and a machine's speed wanders: one re-plan at half a 30-minute run did not follow what came
after it), so the run ends on its budget with its schedule complete.

:class:`TimeBudget` keeps the clock of a budgeted run across interruptions: the seconds spent by earlier runs
come back from the checkpoint with the plan (and how many times it was re-planned), so a rerun continues to the
same total steps and the same deadline.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

LOG = logging.getLogger(__name__)

CALIBRATION_SECONDS = 60.0  # steps are timed for this long (at most 20% of the budget) before the plan is fixed
CALIBRATION_MIN_STEPS = 5
SKIP_FIRST_STEPS = 2  # the first steps pay for kernel selection and allocation: not timed
REPLAN_FRACTIONS = (0.5, 0.8)  # a budgeted run plans its length again when these fractions of the budget are spent


@dataclass
class Schedule:
    """Learning rate and key momentum at every step of a run of ``total_steps``.

    Args:
        peak_lr: the learning rate after warm-up (already scaled by the batch).
        warmup_steps: steps of linear warm-up from ``peak_lr / warmup_steps``.
        total_steps: the last step; the cosine reaches 0 there.
        m0: the key momentum at the start; ``momentum_fn(m0, progress)`` gives it at ``progress`` in [0, 1].
    """

    peak_lr: float
    warmup_steps: int
    total_steps: int
    m0: float
    momentum_fn: object

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def momentum(self, step: int) -> float:
        return self.momentum_fn(self.m0, step / max(1, self.total_steps))


@dataclass
class TimeBudget:
    """The clock and the plan of a ``--time-budget`` run.

    Args:
        seconds: the whole budget.
        spent: seconds already spent by earlier runs of the same run directory.
        total_steps: the planned steps when an earlier run already fixed them (0: not yet).
        replans: how many of the re-plans at :data:`REPLAN_FRACTIONS` of the budget were already made.
    """

    seconds: float
    spent: float = 0.0
    total_steps: int = 0
    replans: int = 0
    started: float = field(default_factory=time.perf_counter)
    _steps: int = 0  # steps this process has trained (a budget is made per process)
    _timed_seconds: float = 0.0  # of all but its first SKIP_FIRST_STEPS
    _since_plan: tuple[int, float] = (0, 0.0)  # (_timed_steps, _timed_seconds) when this process last planned

    @classmethod
    def resumed(cls, seconds: float, saved: dict) -> "TimeBudget":
        """The budget of a run whose checkpoint holds ``saved`` (what :meth:`to_saved` wrote; ``{}``: a new run).
        A checkpoint written before the second re-plan holds ``replanned`` (a bool) instead of ``replans``."""
        return cls(
            seconds,
            spent=saved.get("spent_seconds", 0.0),
            total_steps=saved.get("total_steps", 0),
            replans=saved.get("replans", int(saved.get("replanned", False))),
        )

    def to_saved(self) -> dict:
        """What a checkpoint keeps of the budget, so that a rerun continues to the same plan and deadline."""
        return {"total_steps": self.total_steps, "spent_seconds": self.elapsed(), "replans": self.replans}

    @property
    def calibrated(self) -> bool:
        return self.total_steps > 0

    def elapsed(self) -> float:
        """Seconds of the budget used so far, earlier runs included."""
        return self.spent + time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.seconds - self.elapsed()

    def record_step(self, seconds: float) -> None:
        """Time one optimizer step. The first :data:`SKIP_FIRST_STEPS` of this process are not counted; those at
        an epoch's start are (an epoch's start recurs: it is part of the speed to plan with, and a collection of
        two or three batches has no other steps: skipping the first two of each epoch never planned its run)."""
        self._steps += 1
        if self._steps > SKIP_FIRST_STEPS:
            self._timed_seconds += seconds

    @property
    def _timed_steps(self) -> int:
        return max(0, self._steps - SKIP_FIRST_STEPS)

    @property
    def seconds_per_step(self) -> float | None:
        """The speed to plan with: seconds per step timed since this process last planned (the speed can drift
        within a run), or since it started when it has not planned yet."""
        steps = self._steps_since_plan
        return (self._timed_seconds - self._since_plan[1]) / steps if steps else None

    @property
    def _steps_since_plan(self) -> int:
        """Steps timed since this process last planned (since it started, before its first plan)."""
        return self._timed_steps - self._since_plan[0]

    def planned(self, total_steps: int) -> None:
        """Fix the plan at ``total_steps``; a plan made after the first counts as a re-plan, and the next one
        times the steps from here."""
        if self.calibrated:
            self.replans += 1
        self.total_steps = total_steps
        self._since_plan = (self._timed_steps, self._timed_seconds)

    @property
    def replanned_at(self) -> tuple[float, ...]:
        """The fractions of the budget at which the plan was made again so far."""
        return REPLAN_FRACTIONS[: self.replans]

    def calibration_due(self) -> bool:
        """True once enough steps were timed to plan the rest of the run."""
        window = min(CALIBRATION_SECONDS, 0.2 * self.seconds)
        return not self.calibrated and self._timed_steps >= CALIBRATION_MIN_STEPS and self._timed_seconds >= window

    def replan_due(self) -> bool:
        """True once at each of :data:`REPLAN_FRACTIONS` of the budget: plan the rest of the run again from the
        speed timed since the plan before (the first minute's alone was off by 5-15%, either way; a second re-plan
        follows a machine that slowed or sped up after the first), once this process has timed a few steps since."""
        return (
            self.calibrated
            and self.replans < len(REPLAN_FRACTIONS)
            and self._steps_since_plan >= CALIBRATION_MIN_STEPS
            and self.elapsed() >= REPLAN_FRACTIONS[self.replans] * self.seconds
        )

    def estimate_total(self, step: int, reserve_seconds: float) -> int:
        """The total steps that fit in the budget at the measured speed, keeping ``reserve_seconds`` for
        evaluations and checkpoints."""
        per_step = self.seconds_per_step or 1.0
        return step + max(1, int(max(0.0, self.remaining() - reserve_seconds) / per_step))

    def should_stop(self, step: int) -> bool:
        """Stop when the planned steps are done or the time is up."""
        return (self.calibrated and step >= self.total_steps) or self.remaining() <= 0
