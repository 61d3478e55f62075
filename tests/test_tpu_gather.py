"""Compressed payload words under TPUStrategy's all_gather (value x one-hot mask, summed).

No TPU here: `tpu_standins` applies TensorFlow's own formula (and its own _TPUReplicaContext
code) with the TPU's float arithmetic. The float32-bitcast path is shown to corrupt words
there; the int32 path tfpar now takes on TPU arrives bit for bit.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar.compression import accounting, gather
from tfpar.compression.compressed_aggregator import _all_gather_words
from tpu_standins import MaskAndSumContext, mask_and_sum_gather

# Words as float32 they would be: 0, subnormals (top-k indices < 2^23), -0.0, NaNs, +-Inf,
# large indices, negative ints.
PATTERNS = np.array([0, 1, 5, 2**22, 2**23 - 1, -2**31, 0x7FC00000, 0x7FC00001, -1,
                     0x7F800000, -0x00800000, 2**31 - 1, 123_456_789, 2**24 + 3, -7],
                    dtype=np.int64).astype(np.int32)
OTHER = np.roll(PATTERNS, 3)  # replica 1's words: each position meets a different pattern


def two_replicas():
    return np.stack([PATTERNS, OTHER])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "xla"])
def test_int32_words_survive_the_mask_and_sum_gather(jit):
    run = tf.function(mask_and_sum_gather, jit_compile=True) if jit else mask_and_sum_gather
    np.testing.assert_array_equal(run(tf.constant(two_replicas())).numpy(), two_replicas())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "xla"])
def test_float32_bits_are_corrupted_by_the_mask_and_sum_gather(jit):
    """The bug tfpar had on TPU: the words bitcast to float32 for the gather."""
    def bitcast_gather(words):
        return tf.bitcast(mask_and_sum_gather(tf.bitcast(words, tf.float32)), tf.int32)

    run = tf.function(bitcast_gather, jit_compile=True) if jit else bitcast_gather
    got = run(tf.constant(two_replicas())).numpy()
    sent = two_replicas()
    assert got[0, 1] == 0 and got[0, 4] == 0          # subnormals (small indices) flushed
    assert got[0, 5] == 0                              # -0.0 + 0.0 = +0.0
    assert np.isnan(got[1, 6:9].view(np.float32)).all()  # replica 0's NaNs poison replica 1
    assert (got != sent).sum() >= 8


def mirrored(replicas):
    return tfpar.create_strategy("mirrored", devices=[f"/cpu:{i}" for i in range(replicas)])


def run_in_tpu_context(strategy, function):
    """`function(context, replica_id)` in every replica, the context a TPU stand-in."""
    contexts = []

    @tf.function
    def step():
        def replica():
            context = MaskAndSumContext(tf.distribute.get_replica_context())
            contexts.append(context)
            return function(context, context.replica_id_in_sync_group)
        return strategy.run(replica)

    return [t.numpy() for t in strategy.experimental_local_results(step())], contexts


def words_of(replica_id):
    return tf.where(tf.equal(replica_id, 0), tf.constant(PATTERNS), tf.constant(OTHER))[None]


def test_compression_gathers_int32_through_tensorflows_tpu_all_gather():
    strategy = mirrored(2)
    results, contexts = run_in_tpu_context(
        strategy, lambda context, r: _all_gather_words(context, words_of(r)))
    for gathered in results:
        np.testing.assert_array_equal(gathered, two_replicas())
    # What the TPU's CrossReplicaSum gets: int32, R x the payload.
    assert contexts[0].summed == [(tf.int32, (2, 1, len(PATTERNS)))]


def test_the_stand_in_reproduces_the_float_corruption():
    strategy = mirrored(2)
    results, _ = run_in_tpu_context(strategy, lambda context, r: tf.bitcast(
        context.all_gather(tf.bitcast(words_of(r), tf.float32), axis=0), tf.int32))
    assert (results[0] != two_replicas()).sum() >= 8


def test_other_strategies_keep_the_bitcast_gather():
    strategy = mirrored(2)

    @tf.function
    def step():
        def replica():
            context = tf.distribute.get_replica_context()
            assert not gather.gathers_by_sum(context)
            return _all_gather_words(context, words_of(context.replica_id_in_sync_group))
        return strategy.run(replica)

    for gathered in strategy.experimental_local_results(step()):
        np.testing.assert_array_equal(gathered.numpy(), two_replicas())


def test_a_tpu_strategy_is_recognised_by_its_extended():
    from tensorflow.python.distribute import tpu_strategy

    class Strategy:
        extended = object.__new__(tpu_strategy.TPUExtended)

    class Context:
        strategy = Strategy()

    assert gather.gathers_by_sum(Context())
    with pytest.raises(TypeError, match="int32"):
        gather.all_gather_words(Context(), tf.zeros([1, 2], tf.float32))


def test_tpu_collectives_are_counted_a_gather_as_replicas_times_payload():
    replicas, words = 8, 100

    @tf.function
    def program(payload):
        mask = tf.cast(tf.one_hot(3, replicas), tf.int32)[:, None]
        summed = tf.raw_ops.CrossReplicaSum(input=payload[None] * mask,
                                            group_assignment=[list(range(replicas))])
        tiled = tf.tile(tf.cast(payload, tf.float16)[None], [replicas, 1])
        swapped = tf.raw_ops.AllToAll(input=tiled, group_assignment=[list(range(replicas))],
                                      concat_dimension=0, split_dimension=0, split_count=replicas)
        return summed, swapped

    traced = program.get_concrete_function(tf.TensorSpec([words], tf.int32))
    found = {c.type: c.bytes for c in accounting.collectives(traced)}
    assert found == {"CrossReplicaSum": replicas * words * 4, "AllToAll": replicas * words * 2}
    assert accounting.bytes_per_replica(traced) == replicas * words * 6
