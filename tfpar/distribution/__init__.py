"""keras.distribution on TensorFlow, through tfpar: `tfpar.distribution.enable()`.

Keras 3's distribution API (`DeviceMesh`, `LayoutMap`, `DataParallel`, `ModelParallel`) is
what Keras users already write for data and model parallelism; on the TensorFlow backend
Keras ignores it (its TensorFlow `distribution_lib` is a prototype that distributes
nothing). One line makes it run through tfpar: a `DataParallel` trains under the strategy
tfpar would pick, a `ModelParallel`'s layout map splits the model's own Dense, EinsumDense
and Embedding weights (tensor parallelism, tfpar.tensor_parallel), and `model.fit` and
`tfpar.Trainer` both train it, equal to the model on one device.

Why one switch and Keras's own classes, not tfpar's look-alikes: the programs users have
(the keras.io guide, keras-hub's `get_layout_map`) then run unchanged, and disable() puts
Keras back.

- mesh.py: a distribution's strategy, its device order and its tensor-parallel layout
- enabled.py: enable() / disable(): where Keras is hooked
- keras_trainer.py: Keras's fit / evaluate / predict for a split model

Example:
    >>> import keras, tfpar
    >>> tfpar.distribution.enable()
    >>> keras.distribution.set_distribution(keras.distribution.DataParallel())
    >>> model = make_model(); model.compile(...); model.fit(dataset)   # mirrored over every device
"""

from tfpar.distribution.enabled import disable, enable, is_enabled
from tfpar.distribution.mesh import Plan, current_plan, plan_of

__all__ = ["Plan", "current_plan", "disable", "enable", "is_enabled", "plan_of"]
