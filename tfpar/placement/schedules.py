"""Pipeline schedules: the order of the work units on each device, and their ideal timing.

A unit is ("F", g, m), ("B", g, m) or ("W", g, m): the forward, the backward (for the
zero-bubble schedule only the input-gradient half) and the weight-gradient half of stage
group g on micro-batch m. `order(schedule, devices, groups, M)` lists each device's units;
group g runs on device g % devices (one group per device, except interleaved).

- `naive` / `gpipe`: every forward, then every backward (fill, then drain).
- `1f1b`: S - d warm-up forwards on device d, then one backward, one forward.
- `interleaved` (Megatron's interleaved 1F1B): v = groups / devices chunks per device,
  group g on device g % S; micro-batches go through in rounds of S; bubble / v.
- `zb-h1` (zero bubble, Qi et al. 2023): backward split into B (input gradient, on the
  critical path) and W (weight gradient, any time later); each device runs B first, then F
  while it holds fewer than 1F1B's S - d micro-batches, then a deferred W, so the W's fill
  the cool-down. Same activation limit as 1F1B, a third of its bubble when F = B = W.

`simulate(orders, durations)` replays the orders with the data dependencies and fixed
unit durations; `bubble_theory` is its bubble at the nominal durations (F = B = W, a full
backward = B + W), which is (S-1)/(M+S-1) for gpipe/1f1b, (S-1)/(vM+S-1) interleaved and
(S-1)/(3M+S-1) for zb-h1.

Example:
    >>> order("1f1b", 2, 2, 2)[0]
    [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('B', 0, 1)]
"""

from __future__ import annotations

from typing import Mapping

from tfpar.placement.plan import PlacementError

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # schedules with separate B and W units
NOMINAL = {"F": 1.0, "B": 1.0, "W": 1.0}

Unit = tuple  # (kind, group, micro-batch)


def order(schedule: str, devices: int, groups: int, micro_batches: int,
          durations: Mapping = NOMINAL) -> list[list[Unit]]:
    """Per device, its units in the order it runs them. `durations` (seconds by kind, or by
    (kind, device)) shape the zb-h1 order; the other schedules' orders are fixed."""
    if schedule not in SCHEDULES:
        raise PlacementError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if schedule == "interleaved":
        return [_interleaved(d, devices, groups // devices, micro_batches) for d in range(devices)]
    if schedule == "zb-h1":
        return _zb_h1(devices, micro_batches, durations)
    m_all = range(micro_batches)
    if schedule in ("naive", "gpipe"):
        return [[("F", d, m) for m in m_all] + [("B", d, m) for m in reversed(m_all)]
                for d in range(devices)]
    return [_one_f_one_b(d, devices, micro_batches) for d in range(devices)]


def _one_f_one_b(d: int, devices: int, micro_batches: int) -> list[Unit]:
    warm = min(devices - d, micro_batches)
    forwards = [("F", d, m) for m in range(micro_batches)]
    backwards = [("B", d, m) for m in range(micro_batches)]
    steady = [u for i in range(micro_batches - warm) for u in (backwards[i], forwards[warm + i])]
    return forwards[:warm] + steady + backwards[micro_batches - warm:]


def _interleaved(d: int, devices: int, chunks: int, micro_batches: int) -> list[Unit]:
    """Megatron's order: forward k is chunk (k // S) % v of micro-batch (k // Sv) * S + k % S;
    backwards the same with the chunks reversed; (S - d - 1) * 2 + (v - 1) * S warm-up."""
    total, S = micro_batches * chunks, devices

    def unit(kind, k):
        chunk = (k // S) % chunks
        chunk = chunk if kind == "F" else chunks - 1 - chunk
        return (kind, chunk * S + d, (k // (S * chunks)) * S + k % S)

    warm = min((S - d - 1) * 2 + (chunks - 1) * S, total)
    steady = [u for i in range(total - warm) for u in (unit("F", warm + i), unit("B", i))]
    return [unit("F", k) for k in range(warm)] + steady + \
        [unit("B", k) for k in range(total - warm, total) if k >= 0]


def _zb_h1(devices: int, micro_batches: int, durations: Mapping = NOMINAL) -> list[list[Unit]]:
    """The zero-bubble order for these unit durations: a greedy list schedule (B when its
    gradient has arrived, else F within the memory limit, else the oldest deferred W) tried
    with a few policies; the one whose replay ends first wins (the fewest activations held
    on a tie). With measured durations (`durations[(kind, device)]`, e.g. from
    `timeline.unit_times`) this is a profile-guided order, as the paper's automatic schedule."""
    best = None
    for limit, lazy_w in ((_ZB_MEMORY_1F1B, False), (_ZB_MEMORY_1F1B, True),
                          (_ZB_MEMORY_H1, False), (_ZB_MEMORY_H1, True)):
        orders = _zb_greedy(devices, micro_batches, durations, limit, lazy_w)
        span = simulate(orders, devices, durations, split_backward=True)
        key = (round(max(end for _, end in span.values()), 9), limit is _ZB_MEMORY_H1)
        if best is None or key < best[0]:
            best = (key, orders)
    return best[1]


def _ZB_MEMORY_1F1B(d: int, devices: int) -> int:
    return devices - d  # micro-batches held (F done, W not): exactly 1F1B's


def _ZB_MEMORY_H1(d: int, devices: int) -> int:
    return devices  # every device may hold what device 0 holds: the same peak as 1F1B


def _duration(durations: Mapping, kind: str, d: int) -> float:
    return durations.get((kind, d), durations.get(kind, NOMINAL[kind]))


def _zb_greedy(devices, micro_batches, durations, limit, lazy_w) -> list[list[Unit]]:
    """The device that can start something earliest goes next (see `_zb_choice`)."""
    orders: list[list[Unit]] = [[] for _ in range(devices)]
    done: dict[Unit, float] = {}
    free = [0.0] * devices
    state = [{"f": 0, "b": 0, "w": 0} for _ in range(devices)]
    while len(done) < 3 * devices * micro_batches:
        best = None
        for d in range(devices):
            choice = _zb_choice(d, devices, micro_batches, state[d], done, free[d],
                                limit(d, devices), _duration(durations, "W", d) if lazy_w else 0.0)
            if choice and (best is None or choice[0] < best[0]):
                best = choice + (d,)
        if best is None:
            raise PlacementError("zb-h1 order deadlocked (a bug in the schedule).")
        start, unit, d = best
        done[unit] = free[d] = start + _duration(durations, unit[0], d)
        state[d][unit[0].lower()] += 1
        orders[d].append(unit)
    return orders


def _zb_choice(d, devices, micro_batches, st, done, free, held, w_slack):
    """(start time, unit) of device d's next unit, by priority B > F > W, or None. With a
    `w_slack` (W's duration), a W is not started when it would delay a B or F that is due
    before it ends: the device waits for that one instead."""
    options = []
    f, b, w = st["f"], st["b"], st["w"]
    if b < f:
        ready = max(done[("F", d, b)], done.get(("B", d + 1, b), float("inf")) if d < devices - 1 else 0)
        options.append((max(free, ready), 0, ("B", d, b)))
    if f < micro_batches and f - b < devices - d and f - w < held:
        ready = done.get(("F", d - 1, f), float("inf")) if d > 0 else 0.0
        options.append((max(free, ready), 1, ("F", d, f)))
    if w < b:
        options.append((max(free, done[("B", d, w)]), 2, ("W", d, w)))
    options = [o for o in options if o[0] != float("inf")]
    if not options:
        return None
    urgent = [o for o in options if o[1] < 2 and o[0] < free + w_slack]
    if w_slack and urgent:
        options = urgent
    start = min(o[0] for o in options)
    return start, min(o for o in options if o[0] == start)[2]


def simulate(orders: list[list[Unit]], groups: int, durations: Mapping = NOMINAL,
             split_backward: bool = False) -> dict[Unit, tuple[float, float]]:
    """(start, end) of every unit when each device runs its order at fixed durations
    (`durations[kind]` or `durations[(kind, device)]`; a full backward lasts B + W unless
    `split_backward`) and waits for its inputs."""
    def length(kind, d):
        def one(k):
            return durations.get((k, d), durations.get(k))
        return one("B") + one("W") if kind == "B" and not split_backward else one(kind)

    span: dict[Unit, tuple[float, float]] = {}
    position, free = [0] * len(orders), [0.0] * len(orders)
    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for d, units in enumerate(orders):
            while position[d] < len(units):
                kind, g, m = units[position[d]]
                needs = {"F": [("F", g - 1, m)] if g else [],
                         "B": [("F", g, m)] + ([("B", g + 1, m)] if g < groups - 1 else []),
                         "W": [("B", g, m)]}[kind]
                if any(n not in span for n in needs):
                    break
                start = max([free[d]] + [span[n][1] for n in needs])
                span[units[position[d]]] = (start, start + length(kind, d))
                free[d], position[d], progressed = start + length(kind, d), position[d] + 1, True
        if not progressed:
            raise PlacementError("This schedule deadlocks: a device waits for a unit that is "
                                 "ordered after its own.")
    return span


def bubble(span: Mapping[Unit, tuple[float, float]], devices: int) -> float:
    """Idle share of devices x makespan."""
    ends = [e for _, e in span.values()]
    busy = sum(e - s for s, e in span.values())
    return 1.0 - busy / (devices * max(ends)) if ends else 0.0


def bubble_theory(schedule: str, devices: int, groups: int, micro_batches: int) -> float:
    """The schedule's bubble at nominal durations (F = B = W; see the module docstring)."""
    orders = order(schedule, devices, groups, micro_batches)
    return bubble(simulate(orders, groups, split_backward=schedule in SPLIT_BACKWARD), devices)
