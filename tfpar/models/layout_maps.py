"""keras.distribution layout maps for the models tfpar knows how to split.

A keras-hub backbone that ships `get_layout_map(mesh)` (Llama, Gemma, Qwen, ...) is split by
its own map; for the others tfpar documents one here, Megatron's split of a transformer:
attention by heads (query, key and value column-parallel, the output projection
row-parallel), the MLP by its width (the first layer column-parallel, the second
row-parallel), the token embedding by its vocabulary (a tied output head then computes its
logits column-parallel, gathered). Norms, position embeddings and biases that are added
after a sum stay whole.

| model | map |
| --- | --- |
| keras-hub `GPT2Backbone` | `gpt2(mesh)` below |
| keras-hub `LlamaBackbone`, by Megatron's split (2 all-reduces forward per block, not 5) | `llama_megatron(mesh)` below |
| keras-hub `LlamaBackbone`, `GemmaBackbone`, `QwenBackbone`, ... | their own `get_layout_map(mesh)` |

Example:
    >>> mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], keras.distribution.list_devices())
    >>> keras.distribution.set_distribution(keras.distribution.ModelParallel(
    ...     layout_map=layout_map_for("GPT2Backbone", mesh), batch_dim_name="batch"))
"""

from __future__ import annotations

import keras

from tfpar.tensor_parallel.layout import TensorParallelError


def gpt2(mesh, model_axis: str = "model", batch_axis: str = "batch") -> keras.distribution.LayoutMap:
    """Megatron's split of keras-hub's GPT2Backbone (and its CausalLM's tied head).

    Its weights (per block): `self_attention/{query,key,value}/kernel` [hidden, heads, head]
    and their biases [heads, head]; `self_attention/attention_output/kernel` [heads, head,
    hidden]; `feedforward_intermediate_dense/kernel` [hidden, inner] and bias;
    `feedforward_output_dense/kernel` [inner, hidden]; `token_embedding/embeddings`
    [vocabulary, hidden]."""
    del batch_axis  # GPT2's weights stay whole along the batch axis (no ZeRO entries here)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = (model_axis, None)
    layout_map[r"transformer_layer.*self_attention/(query|key|value)/kernel"] = (None, model_axis, None)
    layout_map[r"transformer_layer.*self_attention/(query|key|value)/bias"] = (model_axis, None)
    layout_map[r"transformer_layer.*self_attention/attention_output/kernel"] = (model_axis, None, None)
    layout_map[r"transformer_layer.*feedforward_intermediate_dense/kernel"] = (None, model_axis)
    layout_map[r"transformer_layer.*feedforward_intermediate_dense/bias"] = (model_axis,)
    layout_map[r"transformer_layer.*feedforward_output_dense/kernel"] = (model_axis, None)
    return layout_map


def llama_megatron(mesh, model_axis: str = "model", batch_axis: str = "batch") -> keras.distribution.LayoutMap:
    """Megatron's split of keras-hub's LlamaBackbone (Mistral's and Qwen's weights have the
    same names), instead of its own `get_layout_map`: that one splits the query, key and
    value kernels along their input features (row-parallel: an all-reduce after each) and
    the output projection along its heads with a whole input (scattered, then summed): 5
    all-reduces forward per block. By heads (column-parallel, then row-parallel) it is 2,
    Megatron's count. The key and value heads (GQA) must be a multiple of the model axis.

    Its weights (per block): `self_attention/{query,key,value}/kernel` [hidden, heads,
    head_dim], `self_attention/attention_output/kernel` [heads, head_dim, hidden],
    `feedforward_{intermediate,gate}_dense/kernel` [hidden, inner],
    `feedforward_output_dense/kernel` [inner, hidden]; `token_embedding/embeddings`
    [vocabulary, hidden] and, untied, `token_embedding/reverse_embeddings` [hidden, vocabulary]."""
    del batch_axis
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = (model_axis, None)
    layout_map["token_embedding/reverse_embeddings"] = (None, model_axis)
    layout_map[r"transformer_layer.*self_attention/(query|key|value)/kernel"] = (None, model_axis, None)
    layout_map[r"transformer_layer.*self_attention/attention_output/kernel"] = (model_axis, None, None)
    layout_map[r"transformer_layer.*feedforward_(intermediate|gate)_dense/kernel"] = (None, model_axis)
    layout_map[r"transformer_layer.*feedforward_output_dense/kernel"] = (model_axis, None)
    return layout_map


MAPS = {"GPT2Backbone": gpt2}


def layout_map_for(backbone, mesh, model_axis: str = "model", batch_axis: str = "batch"):
    """The layout map of a keras-hub backbone (a class, an instance or its class name):
    tfpar's where this module has one, else the backbone's own `get_layout_map`.

    Raises:
      TensorParallelError: a backbone with neither, named.
    """
    name = backbone if isinstance(backbone, str) else (backbone.__name__ if isinstance(backbone, type)
                                                       else type(backbone).__name__)
    if name in MAPS:
        return MAPS[name](mesh, model_axis, batch_axis)
    cls = backbone if isinstance(backbone, type) else (None if isinstance(backbone, str) else type(backbone))
    if cls is None:
        import keras_hub  # pylint: disable=import-outside-toplevel

        cls = getattr(keras_hub.models, name, None)
    if cls is not None and hasattr(cls, "get_layout_map"):
        return cls.get_layout_map(mesh, model_parallel_dim_name=model_axis, data_parallel_dim_name=batch_axis)
    raise TensorParallelError(
        f"tfpar has no layout map for {name}: keras-hub backbones with get_layout_map (Llama, Gemma, "
        f"Qwen, ...) and {', '.join(MAPS)} split; for another model write a keras.distribution.LayoutMap "
        "(docs/keras_distribution.md).")
