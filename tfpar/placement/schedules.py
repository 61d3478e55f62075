"""Pipeline schedules: the order of the work units on each device, and their ideal timing.

A unit is ("F", g, m), ("B", g, m) or ("W", g, m): the forward, the backward (for the
zero-bubble schedule only the input-gradient half) and the weight-gradient half of stage
group g on micro-batch m. `order(schedule, devices, groups, M)` lists each device's units;
group g runs on device g % devices (one group per device, except interleaved), or in a V
for zb-v (`v_device`).

- `naive` / `gpipe`: every forward, then every backward (fill, then drain).
- `1f1b`: S - d warm-up forwards on device d, then one backward, one forward.
- `interleaved` (Megatron's interleaved 1F1B): v = groups / devices chunks per device,
  group g on device g % S; micro-batches go through in rounds of S; bubble / v.
- `zb-h1` (zero bubble, Qi et al. 2023): backward split into B (input gradient, on the
  critical path) and W (weight gradient, any time later); each device runs B first, then F
  while it holds fewer than 1F1B's S - d micro-batches, then a deferred W, so the W's fill
  the cool-down. Same activation limit as 1F1B, a third of its bubble when F = B = W.
- `zb-v` (ZB-V, Qi et al. 2024): 2S groups in a V, group g on device g and group 2S-1-g
  too (device 0 holds the first and the last), B and W split as zb-h1. The micro-batch
  comes back through every device, so the warm-up fills without idling: at F = B = W the
  only bubble is device d's wait of d forwards for its first input (and its mirror at the
  end), (S-1)/(6M+S-1), for M >= S; each device holds at most 2S groups' micro-batches,
  1F1B's peak on device 0 (a group is half a 1F1B stage).

`simulate(orders, durations)` replays the orders with the data dependencies and fixed
unit durations; `bubble_theory` is its bubble at the nominal durations (F = B = W, a full
backward = B + W), which is (S-1)/(M+S-1) for gpipe/1f1b, (S-1)/(vM+S-1) interleaved,
(S-1)/(3M+S-1) for zb-h1 at S = 2 and (S-1)/(6M+S-1) for zb-v at M >= S.

Example:
    >>> order("1f1b", 2, 2, 2)[0]
    [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('B', 0, 1)]
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from tfpar.placement.plan import PlacementError

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
SPLIT_BACKWARD = ("zb-h1", "zb-v")  # schedules with separate B and W units
NOMINAL = {"F": 1.0, "B": 1.0, "W": 1.0}
FORWARD_NUDGE = 0.01  # how much longer forwards are made to break the greedy's ties (see _best)

Unit = tuple  # (kind, group, micro-batch)


def order(schedule: str, devices: int, groups: int, micro_batches: int,
          durations: Mapping = NOMINAL) -> list[list[Unit]]:
    """Per device, its units in the order it runs them. `durations` (seconds by kind, or by
    (kind, device)) shape the zb-h1 and zb-v orders; the other schedules' orders are fixed."""
    if schedule not in SCHEDULES:
        raise PlacementError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if schedule == "interleaved":
        return [_interleaved(d, devices, groups // devices, micro_batches) for d in range(devices)]
    if schedule == "zb-h1":
        return _zb_h1(devices, micro_batches, durations)
    if schedule == "zb-v":
        if groups != 2 * devices:
            raise PlacementError(f"schedule='zb-v' runs 2 groups per device in a V; got {groups} "
                                 f"groups on {devices} devices: use {2 * devices} groups.")
        return _zb_v(devices, micro_batches, durations)
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
    """The zero-bubble order for these unit durations: the greedy list schedule (see
    `_zb_greedy`) tried with a few policies (see `_best`); the one whose replay ends first
    wins (the fewest activations held on a tie). With measured durations
    (`durations[(kind, device)]`, e.g. from `timeline.unit_times`) this is a profile-guided
    order, as the paper's automatic schedule."""
    def one_f_one_b(d):
        return devices - d  # micro-batches held (F done, W not): exactly 1F1B's

    def h1(d):
        return devices  # every device may hold what device 0 holds: the same peak as 1F1B

    policies = [_Policy(memory, one_f_one_b, lazy_w)
                for memory in (one_f_one_b, h1) for lazy_w in (False, True)]
    return _best(list(range(devices)), devices, micro_batches, durations, policies)


def v_device(group: int, devices: int) -> int:
    """The device of `group` in a V (zb-v): g for g < S, 2S - 1 - g after; device 0 holds
    the first and the last group."""
    return min(group, 2 * devices - 1 - group)


def _zb_v(devices: int, micro_batches: int, durations: Mapping = NOMINAL) -> list[list[Unit]]:
    """ZB-V: 2S groups in a V (`v_device`), every device holding at most 2S groups'
    micro-batches (F done, W not), which is 1F1B's peak on device 0 when a group is half a
    1F1B stage. The best of the greedy list schedule under four policies (W after or before
    F; W started even when it delays a due B or F, or not) and the paper's handcrafted V
    order (`_v_handcrafted`), by their replay at `durations`."""
    def limit(_):
        return 2 * devices

    def unlimited(_):
        return float("inf")

    policies = [_Policy(limit, unlimited, lazy_w, w_first)
                for w_first in (False, True) for lazy_w in (False, True)]
    device_of = [v_device(g, devices) for g in range(2 * devices)]
    handcrafted = [_v_handcrafted(d, devices, micro_batches) for d in range(devices)]
    return _best(device_of, devices, micro_batches, durations, policies, [handcrafted])


def _v_handcrafted(d: int, devices: int, micro_batches: int) -> list[Unit]:
    """Device d's ZB-V order as drawn in the paper (Qi et al. 2024, fig. "ZB-V"), written for
    n = max(M, 2S - 1) micro-batches and cut to the M there are. Tokens: "F0" is a forward
    of the device's first group, "B1" a B of its second, and so on."""
    S, n = devices, max(micro_batches, 2 * devices - 1)
    tokens = ["F0"] * (2 * (S - d) - 1) + ["F1", "F0"] * d + ["F1", "B1", "W1"] * (S - d)
    for i in range(n - S):  # steady state: both groups' F, B, W in turn
        tokens += (["F0"] if i < n - 2 * S + d + 1 else []) + ["B0", "W0", "F1", "B1", "W1"]
    tokens += ["B0", "B1"] * d + ["B0", "W0"] * (S - d) + ["W1"] * d + ["W0"] * d
    count: dict[str, int] = {}
    units = []
    for token in tokens:
        m = count[token] = count.get(token, -1) + 1
        if m < micro_batches:
            units.append((token[0], d if token[1] == "0" else 2 * S - 1 - d, m))
    return units


@dataclasses.dataclass(frozen=True)
class _Policy:
    """How the greedy list schedule picks: `memory(d)`, the group micro-batches device d may
    hold (F done, W not); `ahead(d)`, those forwarded ahead of their B; `lazy_w`, never start
    a W that would delay a B or F due before it ends; `w_first`, W before F."""

    memory: Callable[[int], float]
    ahead: Callable[[int], float]
    lazy_w: bool = False
    w_first: bool = False


class _Deadlock(Exception):
    pass


def _best(device_of, devices, micro_batches, durations, policies, fixed=()) -> list[list[Unit]]:
    """Of the greedy orders under `policies` and the `fixed` orders, the one whose replay at
    `durations` ends first; on a tie the one holding the fewest micro-batches, then the first.
    With measured durations the order this picks for equal ones is a candidate too: the
    greedy is not optimal, and at some measured times that order replays shorter than any
    built for those times, so a profiled order never replays longer than it."""
    if durations != NOMINAL:
        fixed = [*fixed, _best(device_of, devices, micro_batches, NOMINAL, policies, fixed)]
    best = None
    # the greedy again with forwards a little longer, its orders replayed at the real times:
    # where units tie the greedy may start a W where the paper's order starts an F (zb-h1 at
    # S = 4, M = 8, F = B = W: 0.172 against the paper's (S-1)/(3M+S-1) = 0.111 that this
    # finds, at the same memory)
    nudged = {key: value * (1 + FORWARD_NUDGE) if (key if isinstance(key, str) else key[0]) == "F" else value
              for key, value in {**NOMINAL, **durations}.items()}
    candidates = [lambda p=p, times=times: _zb_greedy(device_of, devices, micro_batches, times, p)
                  for times in (durations, nudged) for p in policies] + [lambda o=o: o for o in fixed]
    for i, candidate in enumerate(candidates):
        try:
            orders = candidate()
            span = simulate(orders, len(device_of), durations, split_backward=True)
        except (_Deadlock, PlacementError):
            continue
        key = (round(max(end for _, end in span.values()), 9), max(held(orders)), i)
        if best is None or key < best[0]:
            best = (key, orders)
    if best is None:
        raise PlacementError("No zero-bubble order found (a bug in the schedule).")
    return best[1]


def held(orders: list[list[Unit]]) -> list[int]:
    """Per device, the most group micro-batches held at once along its order: forwarded and
    not yet through W (through B for a schedule without W units)."""
    peaks = []
    for units in orders:
        kinds = {k for k, _, _ in units}
        free = "W" if "W" in kinds else "B"
        now = peak = 0
        for kind, _, _ in units:
            now += (kind == "F") - (kind == free)
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def _duration(durations: Mapping, kind: str, d: int) -> float:
    return durations.get((kind, d), durations.get(kind, NOMINAL[kind]))


def _zb_greedy(device_of, devices, micro_batches, durations, policy) -> list[list[Unit]]:
    """A list schedule for any group -> device map: the device that can start a unit
    earliest runs it next (see `_zb_options` for which). Each group's F, B and W go in
    micro-batch order."""
    groups = len(device_of)
    mine = [[g for g in range(groups) if device_of[g] == d] for d in range(devices)]
    done_next = {(k, g): 0 for k in "FBW" for g in range(groups)}  # next micro-batch per kind
    orders: list[list[Unit]] = [[] for _ in range(devices)]
    done: dict[Unit, float] = {}
    free = [0.0] * devices
    while len(done) < 3 * groups * micro_batches:
        best = None
        for d in range(devices):
            slack = _duration(durations, "W", d) if policy.lazy_w else 0.0
            choice = _zb_choice(_zb_options(d, mine[d], groups, micro_batches, done_next, done,
                                            policy), free[d], slack)
            if choice and (best is None or choice[0] < best[0]):
                best = choice + (d,)
        if best is None:
            raise _Deadlock()
        start, unit, d = best
        done[unit] = free[d] = start + _duration(durations, unit[0], d)
        done_next[unit[:2]] += 1
        orders[d].append(unit)
    return orders


def _zb_options(d, mine, groups, micro_batches, done_next, done, policy):
    """(ready time, priority, unit) of device d's candidates: each group's next B, next F
    within the memory limit (keeping a slot for each later group on the device that still
    has forwards to run, or the micro-batch could not reach its B), next W (oldest B
    first); the later group first among Bs and among Fs (it brings its micro-batch closer
    to its end). Ready time inf: waits on another device's unit not run yet."""
    inf, options = float("inf"), []
    holding = sum(done_next["F", g] - done_next["W", g] for g in mine)
    ahead = sum(done_next["F", g] - done_next["B", g] for g in mine)
    w_rank = 0.5 if policy.w_first else 2
    for i, g in enumerate(mine):
        f, b, w = done_next["F", g], done_next["B", g], done_next["W", g]
        if b < f:
            ready = max(done[("F", g, b)], done.get(("B", g + 1, b), inf) if g < groups - 1 else 0.0)
            options.append((ready, (0, -g), ("B", g, b)))
        reserve = sum(1 for h in mine[i + 1:] if done_next["F", h] < micro_batches)
        if f < micro_batches and ahead < policy.ahead(d) and holding + reserve < policy.memory(d):
            options.append((done.get(("F", g - 1, f), inf) if g else 0.0, (1, -g), ("F", g, f)))
        if w < b:
            options.append((done[("B", g, w)], (w_rank, done[("B", g, w)]), ("W", g, w)))
    return options


def _zb_choice(options, free, w_slack):
    """(start time, unit) of the earliest candidate, by priority on a tie, or None. With a
    `w_slack` (W's duration), a W is not started when it would delay a B or F that is due
    before it ends: the device waits for that one instead."""
    options = [(max(free, ready), rank, unit) for ready, rank, unit in options
               if ready != float("inf")]
    if not options:
        return None
    urgent = [o for o in options if o[2][0] != "W" and o[0] < free + w_slack]
    if w_slack and urgent:
        options = urgent
    start, _, unit = min(options)
    return start, unit


def inputs(unit: Unit, groups: int) -> list[Unit]:
    """The units whose results `unit` consumes: F the previous group's F; B its own F and
    the next group's B (the output gradient); W its own B."""
    kind, g, m = unit
    if kind == "F":
        return [("F", g - 1, m)] if g else []
    if kind == "B":
        return [("F", g, m)] + ([("B", g + 1, m)] if g < groups - 1 else [])
    return [("B", g, m)]


def simulate(orders: list[list[Unit]], groups: int, durations: Mapping = NOMINAL,
             split_backward: bool = False) -> dict[Unit, tuple[float, float]]:
    """(start, end) of every unit when each device runs its order at fixed durations
    (`durations[kind]` or `durations[(kind, device)]`; a full backward lasts B + W unless
    `split_backward`) and waits for its inputs."""
    def length(kind, d):
        if kind == "B" and not split_backward:
            return _duration(durations, "B", d) + _duration(durations, "W", d)
        return _duration(durations, kind, d)

    span: dict[Unit, tuple[float, float]] = {}
    position, free = [0] * len(orders), [0.0] * len(orders)
    while any(p < len(o) for p, o in zip(position, orders)):
        progressed = False
        for d, units in enumerate(orders):
            while position[d] < len(units):
                unit = units[position[d]]
                needs = inputs(unit, groups)
                if any(n not in span for n in needs):
                    break
                start = max([free[d]] + [span[n][1] for n in needs])
                end = start + length(unit[0], d)
                span[unit] = (start, end)
                free[d], position[d], progressed = end, position[d] + 1, True
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
