"""tfpar.controller: every interval lands on its step, whatever steps_per_loop is."""

import math

import pytest

from tfpar.controller import Controller, plan
from tfpar.errors import NonFiniteError
from tfpar.preemption import Preempted


class FakeCheckpoints:
    def __init__(self):
        self.saved = []

    def save(self, step):
        self.saved.append(step)
        return f"ckpt-{step}"


class Signalled:
    def __init__(self, at_call):
        self.calls, self.at_call = 0, at_call

    def agreed(self):
        self.calls += 1
        return self.calls == self.at_call


def drive(steps, start=0, **options):
    checkpoints, ran = FakeCheckpoints(), []
    controller = Controller(total_steps=steps, start_step=start, checkpoints=checkpoints,
                            say=lambda message: None, **options)
    controller.run(lambda n: ran.append(n) or 1.0)
    return checkpoints.saved, ran, controller


@pytest.mark.parametrize("steps,expected", [
    (30, [30]), (45, [45]), (1000, [200, 400, 600, 800, 1000])])
def test_checkpoints_land_on_their_steps_and_at_the_end(steps, expected):
    saved, ran, controller = drive(steps, steps_per_loop=7, checkpoint_every=200)
    assert saved == expected and sum(ran) == steps and controller.step == steps
    assert max(ran) == 7
    ends = [sum(ran[:i + 1]) for i in range(len(ran))]
    assert all(s in ends for s in expected)  # a run ends on every checkpoint step


def test_plan_cuts_runs_at_every_interval():
    assert plan(0, 30, 7, (200,)) == [7, 7, 7, 7, 2]
    assert plan(0, 45, 7, (200,)) == [7, 7, 7, 7, 7, 7, 3]
    assert plan(190, 215, 7, (200, 50)) == [7, 3, 7, 7, 1]
    assert plan(23, 40, 10, (20,), boundaries=(25,)) == [2, 10, 5]
    assert plan(40, 40, 10, (20,)) == []


def test_log_and_eval_every_land_on_their_steps():
    reports, evaluated = [], []

    class Progress:
        last = {}

        def start(self, step):
            pass

        def report(self, step, loss):
            reports.append((step, loss))
            return {"step": step, "loss": loss}

        def pause_ends(self):
            pass

    controller = Controller(total_steps=45, steps_per_loop=7, log_every=10, eval_every=15,
                            progress=Progress(), say=lambda m: None,
                            evaluate=lambda: evaluated.append(controller.step) or {"loss": 1.0})
    losses = iter(range(1, 100))
    controller.run(lambda n: float(next(losses)))
    assert [s for s, _ in reports] == [10, 20, 30, 40, 45]
    assert evaluated == [15, 30] and sorted(controller.evaluations) == [15, 30]  # 45: the caller's final eval
    # each report's loss is the mean over its steps (runs 7, 3 -> losses 1, 2 weighted)
    assert math.isclose(reports[0][1], (1 * 7 + 2 * 3) / 10)


def test_resume_at_an_odd_step_keeps_the_intervals():
    saved, ran, _ = drive(1000, start=203, steps_per_loop=7, checkpoint_every=200)
    assert saved == [400, 600, 800, 1000] and sum(ran) == 797 and ran[0] == 7


def test_a_preemption_saves_at_its_step_once_and_exits_75():
    checkpoints = FakeCheckpoints()
    controller = Controller(total_steps=1000, steps_per_loop=7, checkpoint_every=200,
                            checkpoints=checkpoints, preemption=Signalled(at_call=4),
                            say=lambda m: None)
    with pytest.raises(Preempted) as raised:
        controller.run(lambda n: 1.0)
    assert raised.value.step == 28 and raised.value.code == 75 and checkpoints.saved == [28]


def test_a_nonfinite_loss_stops_before_the_checkpoint():
    checkpoints = FakeCheckpoints()
    controller = Controller(total_steps=30, steps_per_loop=10, checkpoint_every=20,
                            checkpoints=checkpoints, stop_on_nonfinite=True, say=lambda m: None)
    losses = iter([1.0, float("nan"), 1.0])
    with pytest.raises(NonFiniteError, match="Step 20 .or one of the 9 steps before it.: the loss is nan"):
        controller.run(lambda n: next(losses))
    assert checkpoints.saved == []


def test_settle_steps_are_the_checkpoint_and_evaluation_steps_ahead():
    """What an asynchronous runner drains at: every step a checkpoint or an evaluation reads
    before the end (the end drains anyway)."""
    controller = Controller(total_steps=50, steps_per_loop=5, start_step=10, checkpoints=FakeCheckpoints(),
                            say=lambda message: None, checkpoint_every=20, eval_every=15)
    assert controller.settle_steps() == {15, 20, 30, 40, 45}



def test_the_preemption_flag_is_agreed_across_replicas():
    """One all-reduce of the flag: a signal seen by one process stops every replica (here 2
    replicas of one process; the two-worker runs are in tests/faults)."""
    import tensorflow as tf

    from tfpar.preemption import PreemptionWatch

    watch = PreemptionWatch(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), signals=())
    assert watch.agreed() is False
    watch.signalled = True
    assert watch.agreed() is True
