"""One traced step of a Pipeline: its units run on their devices in schedule order.

`PipelineStep` keeps what each unit produced (activations forward, their gradients back),
each device's control chain, the op regions the activation accounting reads, and (with
`record`) the units' timestamps. zb-h1 and zb-v split a stage's backward into B (the
input-gradient chain) and W (the weight gradients) from one `tape.gradient` call
(`_weight_only_frontier`); on GPUs a stamp waits for its unit's data (`landed`).

Example:
    >>> step = PipelineStep(pipe, x, y, w, loss_fn, plan.replica_devices[0])
    >>> for unit in pipe._sequence: step.run(unit)      # what Pipeline.forward_backward does
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.placement import activations, tpu_cores
from tfpar.strategy import private_api

KIND = {"F": 0, "B": 1, "W": 2}


class PipelineStep:
    """One traced step's state: what each unit produced, per-device chains, op regions."""

    def __init__(self, pipe, x, y, w, loss_fn, devices):
        m_count = pipe.micro_batches
        self.pipe, self.loss_fn, self.devices = pipe, loss_fn, devices
        self.xs, self.ys = tf.split(x, m_count), tf.split(y, m_count)
        self.ws = tf.split(w, m_count) if w is not None else [None] * m_count
        self.tapes, self.inputs, self.outputs, self.grads_in, self.weights = {}, {}, {}, {}, {}
        self.losses = [None] * m_count
        self.var_grads = [[None] * len(pipe.group_variables(s)) for s in range(len(pipe.groups))]
        self.last = [None] * pipe.devices  # each device's control chain
        self.ends = {}  # (kind, group, micro-batch) -> end stamp, when recording
        self.stamps = []
        self.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self.regions = activations.Regions()

    def _count(self) -> int:
        return len(self.graph.get_operations()) if self.graph is not None else 0

    def run(self, unit) -> None:
        """Runs one unit on its device after the device's previous unit; times it if asked."""
        kind, g, m = unit
        d, device = self.pipe.plan.device_index(g), self.devices[g]
        first = self._count()
        with self.pipe._on(device):
            arriving = {"F": lambda: self.xs[m] if g == 0 else self.outputs[(g - 1, m)],
                        "B": lambda: self.grads_in.get((g + 1, m)), "W": lambda: None}[kind]()
            arriving = self.pipe._hand_to(device, arriving)
            # recorded: a unit also starts after the end stamp of the unit that made its
            # input, so a drawn consumer never seems to end before its producer
            producer = {"F": ("F", g - 1, m), "B": ("B", g + 1, m), "W": None}[kind]
            deps = [t for t in (arriving, self.last[d], self.ends.get(producer)) if t is not None]
            start = self.pipe._stamp(deps, device) if self.pipe.record else None
            deps = [start] if start is not None else deps
            done = {"F": self._forward, "B": self._backward, "W": self._weights}[kind](g, m, arriving, deps)
            done = done or deps  # a unit with nothing to do (B of the first group) keeps the chain
            if self.pipe.record:  # the device's next unit starts after this one's end
                self.last[d] = self.ends[(kind, g, m)] = self.pipe._stamp(done, device)
                self.stamps.append(tf.stack([tf.constant(v, tf.float64) for v in (d, m, KIND[kind])]
                                            + [start, self.last[d], tf.constant(g, tf.float64)]))
            else:
                self.last[d] = tf.group(*done)  # a token, not a stateful op (see _stamp)
        self.regions.add(unit, first, self._count())

    def _forward(self, g, m, h_in, deps):
        with tf.control_dependencies(deps):
            h_in = tf.identity(h_in)  # the stage's work starts here
        if self.graph is not None:
            self.regions.seeds[("F", g, m)] = h_in.op
        tape = tf.GradientTape(persistent=False)
        first_out = []  # the first group's B target: its first layer's output (see _backward)

        def note_first(h):
            if h.dtype.is_floating:  # an integer output has no gradient: B stays empty then
                tape.watch(h)
                first_out.append(h)

        after_first = note_first if g == 0 and self.pipe.split and len(self.pipe.groups[0]) > 1 else None
        with tape:
            if g > 0:
                tape.watch(h_in)
            out = self.pipe._apply(g, h_in, after_first=after_first)
            if g == len(self.pipe.groups) - 1:
                out = self.losses[m] = self.loss_fn(self.ys[m], out, self.ws[m])
        self.tapes[(g, m)], self.outputs[(g, m)] = tape, out
        self.inputs[(g, m)] = h_in if g > 0 else (first_out[0] if first_out else None)
        return [out]

    def _backward(self, g, m, upstream, deps):
        """The stage's backward (zb-h1, zb-v: all of it is built here, the W part set aside).

        B is the gradient of the group's input; in the first group, whose input (token ids,
        say) has none, it is the gradient of its first layer's output: the activation chain
        through the group, as in the zero-bubble paper, so the first device's B is not empty
        with all of its backward left to W. (A first group of one layer has no such chain:
        its B stays empty.)"""
        variables = self.pipe.group_variables(g)
        target = self.inputs[(g, m)]  # the group's input, or (first group, split) its first layer's output
        sources = variables + ([target] if target is not None else [])
        first = len(self.graph.get_operations()) if self.pipe.split else 0
        with tf.control_dependencies(deps):
            result = self.tapes.pop((g, m)).gradient(self.outputs[(g, m)], sources,
                                                     output_gradients=upstream)
            weight_grads = [tf.convert_to_tensor(r) if r is not None else None
                            for r in result[:len(variables)]]
        input_grad = result[-1] if target is not None else None
        if g > 0:
            self.grads_in[(g, m)] = input_grad
        if not self.pipe.split:
            self._accumulate(g, weight_grads)
            return [t for t in weight_grads + [input_grad] if t is not None]
        self.weights[(g, m)] = (_weight_only_frontier(self.graph, first, weight_grads, input_grad,
                                                      self.regions, ("W", g, m)), weight_grads)
        return [input_grad] if input_grad is not None else []

    def _weights(self, g, m, _, deps):
        frontier, weight_grads = self.weights.pop((g, m))
        for op in frontier:  # W's first ops wait for the device's previous unit; TF has no
            for dep in deps:  # public API that adds a control input to an op already built
                private_api.add_control_input(op, dep if isinstance(dep, tf.Operation) else dep.op)
        self._accumulate(g, weight_grads)
        return [t for t in weight_grads if t is not None]

    def _accumulate(self, g, weight_grads) -> None:
        for i, grad in enumerate(weight_grads):
            total = self.var_grads[g][i]
            self.var_grads[g][i] = grad if total is None or grad is None else total + grad


def on_gpu(device: str) -> bool:
    """Whether a stage's `device` is a GPU (not a CPU, a TPU logical core or unnamed)."""
    if not device or tpu_cores.is_logical(device):
        return False
    return tf.DeviceSpec.from_string(device).device_type == "GPU"


def landed(deps: list) -> list:
    """`deps` with their float tensors replaced by one host-side probe of their data.

    A GPU kernel is queued, not finished, when the ops that depend on it by control run, so a
    timestamp after it would stamp the queueing. The probe reads one element of the first
    float tensor, queued on the device after all of them (one stream per device runs its
    kernels in order), and copies it to the host. Its host end is a CheckNumerics (of a value
    made finite first): Grappler's dependency optimizer turns an op whose outputs feed only
    control edges into a NoOp, back up the chain, unless it is on its do-not-rewrite list,
    and then the stamp would wait on control edges from the GPU again.
    """
    def on_device(t) -> bool:  # stamps are on the host already
        return isinstance(t, tf.Tensor) and t.dtype.is_floating and t.op.type != "Timestamp"

    floats = [t for t in deps if on_device(t)]
    if not floats:
        return deps
    with tf.control_dependencies(floats[1:]):
        first = tf.reduce_sum(tf.cast(tf.reshape(floats[0], [-1])[:1], tf.float32))
    first = tf.where(tf.math.is_finite(first), first, tf.zeros_like(first))
    with tf.device("/device:CPU:0"):
        probe = tf.debugging.check_numerics(first, "pipeline timeline probe")
    return [t for t in deps if not on_device(t)] + [probe]


def _weight_only_frontier(graph, first, weight_grads, input_grad, regions, unit) -> list:
    """The ops built since position `first` that feed only the weight gradients (they are
    moved to `unit` in `regions`); returns those without an input from another such op."""
    built = {op.name: op for op in graph.get_operations()[first:]}

    def ancestors(tensors):
        seen, stack = set(), [t.op for t in tensors if t is not None and t.op.name in built]
        while stack:
            op = stack.pop()
            if op.name not in seen:
                seen.add(op.name)
                stack.extend(t.op for t in op.inputs if t.op.name in built)
        return seen

    weight_only = ancestors(weight_grads) - ancestors([input_grad])
    for name in weight_only:
        regions.moved[name] = unit
    return [built[n] for n in weight_only
            if not any(t.op.name in weight_only for t in built[n].inputs)]
