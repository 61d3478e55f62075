"""How a Keras layer computes once some of its weights are split: the parallel styles.

A weight created split (tfpar.tensor_parallel.splitting) makes its layer parallel: the layer
keeps its own call, wrapped so that its split weights compute the same numbers as the
unsplit layer (PyTorch's ColwiseParallel / RowwiseParallel, Megatron's layers):

| layer | weight split along | style | what the call does |
| --- | --- | --- | --- |
| Dense | kernel's output axis (and its bias) | column | f on the input (one per input tensor), the layer's own call: its part of the outputs, split |
| Dense | kernel's input axis | row | the input split (scattered if it comes whole), the product summed over the group (g), then the whole bias and the activation |
| EinsumDense | a kernel axis the output keeps | column | as Dense: its output split along that axis (e.g. heads) |
| EinsumDense | a kernel axis the equation sums over | row | as Dense |
| Embedding | its vocabulary axis | vocabulary | each rank looks up its own rows, the others read 0; the lookups are summed (g) |
| Embedding | its feature axis | feature | each rank looks up its columns; they are gathered |

Where a split activation meets the rest (a layout map says how weights split, not where
activations are summed; this is the rule): a column-parallel layer's output is split and
marked so; it stays split through elementwise layers (Dropout, which then draws its mask
per rank, Activation, keras-hub's rotary embedding) and through raw ops, and a row-parallel
layer takes it as it is; any other layer that is given a marked split activation gets it
gathered whole first (an all-gather), and one that returns one (a block, a model ending in
a column-parallel layer) returns it gathered. A row-parallel layer given a whole input takes
its own part of it. So the same numbers come out whatever the layout map splits, at the
price of a gather where a split activation leaves the region. What no rule can see: a
split activation that raw ops turn into another tensor (no longer marked) and hand to a
layer that needs it whole; such a model fails with a shape error, or is wrong: keep raw ops
between a column-parallel and a row-parallel layer elementwise (as Megatron's MLP and
attention are).

Example:
    >>> with split_weights(layout, [(r"d1/kernel$", 1), (r"d1/bias$", 0)]):
    ...     model = keras.Model(...)         # d1 computes column-parallel inside strategy.run
"""

from __future__ import annotations

import tensorflow as tf
from keras import layers, ops

from tfpar.strategy import private_api
from tfpar.tensor_parallel import shards
from tfpar.tensor_parallel.layout import Layout, TensorParallelError
from tfpar.tensor_parallel.mappings import copy_to_region, gather_along, reduce_from_region, scatter_along

STYLE = "_tfpar_style"  # the attribute a parallel layer's style is kept in
SPLIT = "_tfpar_split_activations"  # on a FuncGraph: tensor ref -> (layout, axis) of split activations

#: Layers that compute element by element (or along an axis a split never touches): a split
#: activation goes through them and stays split.
ELEMENTWISE = (layers.Dropout, layers.Activation, layers.ReLU, layers.LeakyReLU, layers.ELU, layers.PReLU)


# -- split activations: marked in the graph being traced --------------------------------

def mark_split(tensor, layout: Layout, axis: int):
    """Marks `tensor` (in the graph being traced) as split over `layout` along `axis`."""
    graph = getattr(tensor, "graph", None)
    if graph is not None:
        getattr(graph, SPLIT, None) or setattr(graph, SPLIT, {})
        getattr(graph, SPLIT)[tensor.ref()] = (layout, axis % tensor.shape.rank)
    return tensor


def split_axis(tensor):
    """(layout, axis) of a marked split activation, else None."""
    graph = getattr(tensor, "graph", None)
    marks = getattr(graph, SPLIT, None) if graph is not None else None
    return None if not marks or not tf.is_tensor(tensor) else marks.get(tensor.ref())


def made_whole(tensor):
    """A marked split activation all-gathered whole (every other tensor as it is)."""
    found = split_axis(tensor)
    if found is None:
        return tensor
    layout, axis = found
    return gather_along(tensor, layout, axis, name="gathered")


# -- the styles ---------------------------------------------------------------------------

SPLITTABLE = {layers.Dense: ("kernel", "bias"), layers.EinsumDense: ("kernel", "bias"),
              layers.Embedding: ("embeddings", "reverse_embeddings")}  # reverse: keras-hub's ReversibleEmbedding


def check_splittable(layer, name: str, axis: int) -> None:
    """Refuses, by name, a weight tfpar cannot compute with split: another layer type, a
    weight other than a kernel, bias or embedding table, LoRA or quantization."""
    kind = next((k for k in SPLITTABLE if isinstance(layer, k)), None)
    if kind is None or name not in SPLITTABLE[kind]:
        raise TensorParallelError(
            f"{layer.name}/{name} (a {type(layer).__name__} weight) cannot be split: tfpar splits the "
            "kernels and biases of Dense and EinsumDense layers and the table of Embedding layers. "
            f"Leave {layer.name}/{name} whole (replicated): take it out of the layout map.")
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        raise TensorParallelError(f"{layer.name} has LoRA or quantization enabled: split layers run "
                                  "their plain weights; enable them on the unsplit model.")
    kernel = private_api.layer_kernel(layer)
    if name == "bias" and (kernel is None or shards.spec_of(kernel) is None):
        raise TensorParallelError(f"{layer.name}/bias is split but its kernel is whole: split the kernel "
                                  "along an output axis (the bias then follows it).")
    del axis


def bias_axis(layer):
    """The axis a layer's bias splits along when its kernel is split along an output axis
    (column-parallel), else None (the bias stays whole)."""
    kernel = private_api.layer_kernel(layer)
    spec = None if kernel is None else shards.spec_of(kernel)
    if spec is None:
        return None
    if isinstance(layer, layers.Dense):
        return 0 if spec.axis == 1 else None
    if isinstance(layer, layers.EinsumDense) and layer.bias_axes:
        _, output_axis = _einsum_axes(layer.equation, spec.axis)
        if output_axis is None:
            return None
        out = layer.equation.split("->")[1]  # Keras's bias: the output's axes from its first bias axis on
        letter, first = out[output_axis], min(out.find(c) for c in layer.bias_axes)
        return out.find(letter) - first if letter in layer.bias_axes else None
    return None


def parallelize(layer, layout: Layout) -> None:
    """Makes `layer` compute with its split weights (see module docstring). Called when
    its first split weight is made; the style is read from its weights at call time."""
    if getattr(layer, STYLE, None) is not None:
        return
    object.__setattr__(layer, STYLE, layout)
    own = layer.call

    def call(*args, **kwargs):
        if private_api.in_symbolic_scope():  # Keras tracing shapes (a functional model's build)
            return _shapes_call(layer, layout, own, *args, **kwargs)
        layout.here()  # outside strategy.run: refused by name (its replicas hold different shards)
        return _parallel_call(layer, layout, own, *args, **kwargs)

    layer.call = call


def fit_input_spec(layer) -> None:
    """A row-parallel Dense takes a whole input or its part of one: Keras's check of the
    input's last axis (its InputSpec, set by its build) is loosened once."""
    if isinstance(layer, layers.Dense) and not getattr(layer, "_tfpar_spec_fitted", False):
        kernel = private_api.layer_kernel(layer)
        if kernel is not None and shards.spec_of(kernel) is not None and shards.spec_of(kernel).axis == 0:
            layer.input_spec = layers.InputSpec(min_ndim=2)
        object.__setattr__(layer, "_tfpar_spec_fitted", True)


def _shapes_call(layer, layout, own, inputs, *args, **kwargs):
    """What Keras's symbolic pass (shapes only, no collectives, no numbers that count) gets
    from a split layer: the unsplit layer's shapes, so that the layers after it are built
    as in the unsplit model."""
    split = _split_weights(layer)
    if isinstance(layer, layers.Embedding):
        y = own(inputs, *args, **kwargs)
        if kwargs.get("reverse") or (args and args[0] is True):
            tied = getattr(layer, "tie_weights", True)
            spec = shards.spec_of(layer.embeddings if tied else layer.reverse_embeddings)
            return y if spec is None else ops.concatenate([y] * layout.degree, axis=-1)
        return ops.concatenate([y] * layout.degree, axis=-1) if split["embeddings"].axis == 1 else y
    kernel = split.get("kernel")
    if isinstance(layer, layers.Dense):
        inputs_axis, output_axis = (-1, None) if kernel.axis == 0 else (None, -1)
    else:
        inputs_axis, output_axis = _einsum_axes(layer.equation, kernel.axis)
    if output_axis is not None:
        return ops.concatenate([own(inputs, *args, **kwargs)] * layout.degree, axis=output_axis)
    local = int(layer.kernel.shape[kernel.axis])
    if inputs.shape[inputs_axis] != local:
        inputs = tf.gather(inputs, tf.range(local), axis=inputs_axis % inputs.shape.rank)
    y = ops.matmul(inputs, layer.kernel) if isinstance(layer, layers.Dense) else \
        ops.einsum(layer.equation, inputs, layer.kernel)
    if layer.bias is not None:
        y = ops.add(y, layer.bias)
    return y if layer.activation is None else layer.activation(y)


def _split_weights(layer) -> dict:
    return {w.name: shards.spec_of(w) for w in layer.weights if shards.spec_of(w) is not None}


def _parallel_call(layer, layout, own, inputs, *args, **kwargs):
    split = _split_weights(layer)
    if isinstance(layer, layers.Embedding):
        return _embedding(layer, layout, own, inputs, split.get("embeddings"), *args, **kwargs)
    kernel = split.get("kernel")
    if kernel is None:
        raise TensorParallelError(f"{layer.name}'s bias is split but not its kernel: split a layer by "
                                  "its kernel (the bias follows a column split).")
    if isinstance(layer, layers.Dense):
        inputs_axis, output_axis = (-1, None) if kernel.axis == 0 else (None, -1)
    else:
        inputs_axis, output_axis = _einsum_axes(layer.equation, kernel.axis)
    if output_axis is not None:  # column: the input whole, its part of the outputs
        if "bias" not in split and layer.bias is not None:
            raise TensorParallelError(f"{layer.name}'s kernel is split along an output axis but its bias "
                                      "is whole: split the bias along the same axis.")
        y = own(copy_once(made_whole(inputs), layout, name=f"{layer.path}_f"), *args, **kwargs)
        return mark_split(y, layout, output_axis)
    return _row(layer, layout, inputs, inputs_axis)


def _row(layer, layout, inputs, axis: int):
    """The input's part along `axis` (scattered when it comes whole), the partial product
    summed over the group, then the whole bias and the activation."""
    if "bias" in _split_weights(layer):
        raise TensorParallelError(f"{layer.name}'s kernel is split along its input axis: its bias must "
                                  "stay whole (it is added once, after the sum).")
    local = int(layer.kernel.shape[_kernel_axis(layer)])
    found = split_axis(inputs)
    if found is None and inputs.shape[axis] == local * layout.degree:
        inputs = scatter_along(inputs, layout, axis, name=f"{layer.path}_scatter")
    elif inputs.shape[axis] != local:
        raise TensorParallelError(f"{layer.name} takes {local} of {local * layout.degree} input features "
                                  f"along axis {axis} on each rank, got {inputs.shape[axis]}.")
    if isinstance(layer, layers.Dense):
        y = ops.matmul(inputs, layer.kernel)
    else:
        y = ops.einsum(layer.equation, inputs, layer.kernel)
    y = reduce_from_region(y, layout, name=f"{layer.path}_g")
    if layer.bias is not None:
        y = ops.add(y, layer.bias)
    return y if layer.activation is None else layer.activation(y)


def _kernel_axis(layer) -> int:
    return shards.spec_of(layer.kernel).axis


def _einsum_axes(equation: str, kernel_axis: int) -> tuple:
    """(input axis, None) when the kernel axis is summed over (row), (None, output axis)
    when the output keeps it (column), for an EinsumDense equation 'in,kernel->out'."""
    given, out = equation.split("->")
    inputs, kernel = given.split(",")
    if "." in equation:
        raise TensorParallelError(f"EinsumDense equation {equation!r} has an ellipsis: tfpar splits "
                                  "equations with one letter per axis.")
    letter = kernel[kernel_axis]
    if letter in out:
        return None, out.index(letter) - len(out)
    if letter not in inputs:
        raise TensorParallelError(f"EinsumDense equation {equation!r}: kernel axis {kernel_axis} "
                                  f"({letter!r}) is neither in the input nor in the output.")
    return inputs.index(letter) - len(inputs), None


def copy_once(tensor, layout: Layout, name: str):
    """f on `tensor`, once per tensor in a traced graph: several column-parallel layers
    reading one input (Q, K and V) share one f, so its gradient is summed once."""
    graph = getattr(tensor, "graph", None)
    cache = getattr(graph, "_tfpar_copied", None) if graph is not None else None
    if graph is not None and cache is None:
        cache = {}
        setattr(graph, "_tfpar_copied", cache)
    key = (tensor.ref(), id(layout)) if cache is not None else None
    if key is not None and key in cache:
        return cache[key]
    copied = copy_to_region(tensor, layout, name=name)
    if key is not None:
        cache[key] = copied
    return copied


def _embedding(layer, layout, own, inputs, spec, *args, **kwargs):
    """Megatron's vocabulary-parallel embedding (rows split) or a feature split (gathered);
    keras-hub's ReversibleEmbedding in reverse (the logits of a tied head): column-parallel
    over the vocabulary, the logits gathered whole."""
    if kwargs.get("reverse") or (args and args[0] is True):
        return _reverse(layer, layout, own, inputs, *args, **kwargs)
    if spec is None:  # only the reverse table is split
        return own(inputs, *args, **kwargs)
    if spec.axis == 1:
        return gather_along(own(inputs, *args, **kwargs), layout, -1, name=f"{layer.path}_features")
    rows = int(layer.embeddings.shape[0])
    start = layout.rank(layout.here()) * rows
    ids = ops.cast(inputs, "int32") - start
    mine = ops.logical_and(ids >= 0, ids < rows)
    found = ops.take(layer.embeddings, ops.where(mine, ids, 0), axis=0)
    found = ops.where(ops.expand_dims(mine, -1), found, ops.zeros_like(found))
    return reduce_from_region(found, layout, name=f"{layer.path}_g")


def _reverse(layer, layout, own, inputs, *args, **kwargs):
    """keras-hub's ReversibleEmbedding as the output head: its kernel is the table
    transposed (tied) or its own `reverse_embeddings` [features, vocabulary]. Split along
    the vocabulary: column-parallel, the logits gathered; whole: every rank computes them."""
    tied = getattr(layer, "tie_weights", True)
    weight, vocabulary_axis = (layer.embeddings, 0) if tied else (layer.reverse_embeddings, 1)
    spec = shards.spec_of(weight)
    if spec is None:
        return own(made_whole(inputs), *args, **kwargs)
    if spec.axis != vocabulary_axis:
        raise TensorParallelError(f"{layer.name} is split along its features and used in reverse (as the "
                                  "output head): split its vocabulary axis instead.")
    logits = own(copy_once(made_whole(inputs), layout, name=f"{layer.path}_f"), *args, **kwargs)
    return gather_along(logits, layout, -1, name=f"{layer.path}_logits")


# -- the rest of the model: where a split activation leaves the region ------------------

def marks_in_graph() -> bool:
    """Whether the graph being traced holds a marked split activation (cheap: the test
    Keras's Layer.__call__ makes for every layer while tensor parallelism is in use)."""
    return bool(getattr(tf.compat.v1.get_default_graph(), SPLIT, None))


def layer_call(layer, call, args: tuple, kwargs: dict):
    """`call(*args, **kwargs)` (Keras's Layer.__call__) for a layer that is not parallel,
    given split activations: an elementwise layer keeps them split (a Dropout draws its
    mask per rank there), any other gets them gathered whole (see module docstring)."""
    found = [split_axis(t) for t in tf.nest.flatten((args, kwargs)) if tf.is_tensor(t)]
    found = [f for f in found if f is not None]
    if not found or getattr(layer, STYLE, None) is not None:
        return call(*args, **kwargs)
    if isinstance(layer, ELEMENTWISE) or (_rotary(layer) and all(a != args[0].shape.rank - 1 for _, a in found)):
        if isinstance(layer, layers.Dropout):
            per_rank_dropout(layer, found[0][0])
        outputs = call(*args, **kwargs)
        return mark_split(outputs, *found[0]) if tf.is_tensor(outputs) else outputs
    args, kwargs = tf.nest.map_structure(lambda t: made_whole(t) if tf.is_tensor(t) else t, (args, kwargs))
    return call(*args, **kwargs)


def leaving(layer, outputs):
    """A split activation that leaves a layer that is neither parallel nor elementwise (a
    block, a model whose last layer is column-parallel) is gathered whole: what a layer or
    a model returns is whole, as the unsplit one's."""
    if getattr(layer, STYLE, None) is not None or isinstance(layer, ELEMENTWISE) or _rotary(layer):
        return outputs
    return tf.nest.map_structure(lambda t: made_whole(t) if tf.is_tensor(t) else t, outputs)


def per_rank_dropout(dropout, layout: Layout) -> None:
    """A Dropout given a split activation draws its mask per rank (Megatron's tracker:
    inside the split region; tfpar.tensor_parallel.random)."""
    from tfpar.tensor_parallel.random import split_region_dropout  # pylint: disable=import-outside-toplevel

    if "call" not in vars(dropout):
        split_region_dropout(dropout, layout)


def attention_dropout_per_rank(layer) -> None:
    """A Keras MultiHeadAttention (or a subclass: keras-hub's) whose query kernel is split by
    heads draws its attention-probability dropout per rank (its heads are this rank's), once."""
    if not isinstance(layer, layers.MultiHeadAttention) or getattr(layer, "_tfpar_dropout_checked", False):
        return
    query = getattr(layer, "_query_dense", None)
    kernel = private_api.layer_kernel(query) if query is not None else None
    spec = None if kernel is None else shards.spec_of(kernel)
    if spec is not None:
        _, output_axis = _einsum_axes(query.equation, spec.axis)
        if output_axis is not None:  # split by heads (a column split)
            per_rank_dropout(private_api.attention_dropout(layer), getattr(query, STYLE))
    object.__setattr__(layer, "_tfpar_dropout_checked", bool(layer.built))


#: What an attention layer keeps its head counts in (keras-hub's Llama, Gemma, Mistral,
#: Qwen: they reshape by them): with the heads split, each rank reads its own count (1/T of
#: each) inside strategy.run, the whole count everywhere else (config, shapes). Another
#: layer that reshapes by a count of split heads under another name fails with a shape
#: error: add the name here.
HEAD_COUNTS = ("num_query_heads", "num_key_value_heads")
_HEAD_CLASSES: dict = {}


def local_head_counts(layer) -> None:
    """An attention layer with head counts (HEAD_COUNTS) whose query kernel is split by
    heads reads them per rank inside the replicas (a subclass of its class with properties)."""
    names = tuple(n for n in HEAD_COUNTS if isinstance(layer.__dict__.get(n), int))
    if not names or getattr(layer, "_tfpar_heads_checked", False) or not layer.built:
        return
    object.__setattr__(layer, "_tfpar_heads_checked", True)
    layout = next((getattr(sub, STYLE) for sub in layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
                   if getattr(sub, STYLE, None) is not None and isinstance(sub, layers.EinsumDense)
                   and _einsum_axes(sub.equation, shards.spec_of(private_api.layer_kernel(sub)).axis)[1]
                   is not None), None)
    if layout is None:
        return
    object.__setattr__(layer, "_tfpar_heads_layout", layout)  # per instance: the class is shared
    cls = type(layer)
    if cls not in _HEAD_CLASSES:
        def count(name):
            def get(self):
                whole, split = self.__dict__[name], self.__dict__["_tfpar_heads_layout"]
                context = tf.distribute.get_replica_context()
                inside = context is not None and context.strategy is split.strategy
                return whole // split.degree if inside else whole

            def put(self, value):
                self.__dict__[name] = value
            return property(get, put)
        _HEAD_CLASSES[cls] = type(f"SplitHeads{cls.__name__}", (cls,), {n: count(n) for n in names})
    private_api.set_instance_class(layer, _HEAD_CLASSES[cls])


def _rotary(layer) -> bool:
    """keras-hub's RotaryEmbedding rotates each head along its last axis: a split of the
    heads (not of the head's features) goes through it."""
    return any(cls.__name__ == "RotaryEmbedding" for cls in type(layer).__mro__)  # Llama's subclasses it
