"""`tfpar.loop.parameter_server.fetch`: a worker killed between finishing a scheduled
function and handing its result to the chief does not stop the chief (CI caught that race:
tests/test_parameter_server.py's killed worker, once in many runs)."""

import pytest
import tensorflow as tf

from tfpar.loop import parameter_server


class Result:
    """A RemoteValue whose copy to the chief fails `failures` times (the worker that held
    it died; the coordinator runs the function again), or whose function failed for good."""

    def __init__(self, failures: int, failed_for_good: bool = False):
        self.failures, self.calls = failures, 0
        self._error = tf.errors.UnavailableError(None, None, "ps lost") if failed_for_good else None

    def fetch(self):
        self.calls += 1
        if self._error is not None:
            raise self._error
        if self.calls <= self.failures:
            raise tf.errors.UnavailableError(None, None, "recvmsg:Connection reset by peer")
        return 0.25


def test_a_result_lost_on_its_way_to_the_chief_is_fetched_again():
    result = Result(failures=2)
    assert parameter_server.fetch(result) == 0.25
    assert result.calls == 3


def test_a_function_that_failed_for_good_raises_at_once():
    result = Result(failures=0, failed_for_good=True)
    with pytest.raises(tf.errors.UnavailableError, match="ps lost"):
        parameter_server.fetch(result)
    assert result.calls == 1


def test_it_gives_up_after_its_patience():
    result = Result(failures=10**6)
    with pytest.raises(tf.errors.UnavailableError, match="Connection reset"):
        parameter_server.fetch(result, patience_s=0.5)
