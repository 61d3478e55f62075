"""keras.distribution's `LayoutMap`, read as tensor-parallel splits.

A layout map gives each weight path (a regex) one mesh axis name, or None, per dimension.
On a 2-D mesh (batch x model) tfpar reads it so:

- a dimension on the model axis: the weight is split along it over the T devices of the
  model axis (tfpar.tensor_parallel.splitting); the layer then computes with it
  (tfpar.tensor_parallel.styles: column-, row- or vocabulary-parallel, by the dimension);
- a dimension on the batch axis (keras-hub's maps put some there, FSDP-style): the weight
  stays whole, the same numbers; tfpar.Trainer partitions its optimizer state and
  gradients over the data-parallel replicas (ZeRO-2 by default under a keras.distribution,
  tfpar.distribution.Plan.shard_for); noted here, and said once at start;
- None: whole on every device.

What cannot be honoured is refused by name, with the variable, its layout and why: an axis
the mesh does not have, a layout with another number of dimensions than the weight, two
dimensions on the model axis, a dimension the model axis does not divide, a layer type
tfpar cannot split (styles.check_splittable), and an activation laid out on the model axis
(tfpar keeps activations whole between split regions; `distribute_tensor`).

Example:
    >>> reading = LayoutMapSplits(layout_map, batch_axis="batch", model_axis="model", degree=2)
    >>> with split_weights(layout, reading.decide):
    ...     model = build()
    >>> reading.describe()
    'split over model (2): 6 weights; laid out on batch (whole weights): 1'
"""

from __future__ import annotations

from tfpar.tensor_parallel.layout import TensorParallelError


class LayoutMapSplits:
    """The split decisions of one layout map (see module docstring).

    Args:
      layout_map: a keras.distribution.LayoutMap (or any mapping path -> layout: lookups
        are its own, regexes for a LayoutMap).
      batch_axis, model_axis: the mesh's axis names (model_axis None: a data-parallel mesh).
      degree: the size of the model axis (T).
    """

    def __init__(self, layout_map, batch_axis: str, model_axis: str | None, degree: int):
        self.layout_map, self.batch_axis, self.model_axis, self.degree = layout_map, batch_axis, model_axis, degree
        self.split: list[tuple[str, int]] = []  # (path, axis) of every weight split
        self.on_batch: list[str] = []  # paths of the weights laid out on the batch axis

    def layout_of(self, path: str):
        """The axes the map gives `path` (a tuple), or None."""
        found = self.layout_map[path]
        if found is None:
            return None
        return tuple(getattr(found, "axes", found))

    def decide(self, layer, path: str, shape: tuple):
        """The axis to split the weight at `path` (whole `shape`) along, or None.

        Raises:
          TensorParallelError: a layout tfpar cannot honour, named with the variable.
        """
        del layer
        axes = self.layout_of(path)
        if axes is None:
            return None
        known = (None, self.batch_axis, self.model_axis)
        unknown = [a for a in axes if a not in known]
        if unknown:
            raise TensorParallelError(
                f"The layout map gives {path} {axes}, with {unknown[0]!r}, which is not an axis of the "
                f"device mesh ({', '.join(repr(a) for a in known[1:] if a)}): name a mesh axis, or None.")
        if len(axes) != len(shape):
            raise TensorParallelError(
                f"The layout map gives {path} {axes}: {len(axes)} dimension(s), but the weight has shape "
                f"{shape}: give one entry per dimension (None where it stays whole).")
        model_dims = [i for i, a in enumerate(axes) if a is not None and a == self.model_axis]
        if self.batch_axis in axes:
            self.on_batch.append(path)
        if not model_dims or self.degree == 1:
            return None
        if len(model_dims) > 1:
            raise TensorParallelError(
                f"The layout map gives {path} {axes}: {len(model_dims)} dimensions on {self.model_axis!r}; "
                "tfpar splits a weight along one dimension: keep one, None for the others.")
        axis = model_dims[0]
        if shape[axis] % self.degree:
            raise TensorParallelError(
                f"The layout map splits {path} (shape {shape}) along dimension {axis} over the "
                f"{self.degree} devices of {self.model_axis!r}, which do not divide {shape[axis]}: use a "
                f"mesh whose {self.model_axis!r} axis divides {shape[axis]}, or leave dimension {axis} None.")
        self.split.append((path, axis))
        return axis

    def check_activation(self, path: str, axes: tuple) -> None:
        """Refuses an activation laid out on the model axis: tfpar keeps activations whole
        between split regions (and batch-distributed by the strategy)."""
        if self.model_axis is not None and self.model_axis in axes:
            raise TensorParallelError(
                f"The layout map lays the activation {path} out as {axes}, on {self.model_axis!r}: tfpar "
                "keeps activations whole outside the split regions a layer's weights make (the batch is "
                "split by the strategy). Lay it out on the batch axis only, or take it out of the map.")

    def describe(self) -> str:
        """One line: what is split, what is laid out on the batch axis."""
        line = f"split over {self.model_axis} ({self.degree}): {len(self.split)} weights"
        if self.on_batch:
            line += f"; laid out on {self.batch_axis} (whole weights): {len(self.on_batch)}"
        return line
