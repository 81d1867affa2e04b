"""A step of many gradient-accumulation micro-steps, from a trace of three.

With accum=K the step runs K forward and backward passes, then the optimizer. The first pass
allocates the gradients; from the second on each pass finds the state the one before it left
(the gradients there, the previous loss alive until the new one is made) and runs the same
operations: its events are the previous pass's, its own storages in place of that pass's, and the
previous pass's in place of the one before. So the step is traced with TRACED passes, the third
checked to be the second so renamed, and passes 4..K are copies of the third, each storage it
allocates made anew per copy, each it takes from the pass before taken from the copy before. The
optimizer's events after the last pass refer to the last copy's storages where they referred to
the third pass's.

Where the third pass is not the second renamed, or the optimizer refers to the second pass's
storages (a storage living across two passes), the events cannot be extended (`NotExtendable`)
and the step is traced with all K passes. tests/test_fast_path.py checks extended steps against
steps traced with all their passes, field by field.
"""

from __future__ import annotations

TRACED = 3   # passes traced: the first (gradients allocated), the second, and the third, checked against it

# The fields of an event that name a storage (`probe.memory.LiveCounts`' events, and the tracker's
# gradient marks); an event of another kind must be the same in the second and third pass.
_KEY_FIELDS = {"alloc": (1,), "free": (1,), "relabel": (1,), "grad": (1,)}


class NotExtendable(Exception):
    """Why a traced step's passes cannot stand for more: it is traced with all of them."""


def extended(events: list[tuple], passes: int) -> list[tuple]:
    """The events of a step of `passes` accumulation passes, from `events`, those of the same step
    traced with TRACED passes (module docstring). NotExtendable where they cannot be extended."""
    first = next((i for i, e in enumerate(events) if e == ("start",)), len(events))
    starts = [i for i, e in enumerate(events) if e == ("phase", "forward") and i > first]
    end = next((i for i, e in enumerate(events) if e == ("phase", "optimizer")), len(events))
    if len(starts) != TRACED or not starts[-1] < end:
        raise NotExtendable(f"the trace does not hold {TRACED} passes")
    units = [events[starts[0]:starts[1]], events[starts[1]:starts[2]], events[starts[2]:end]]
    made = [[e[1] for e in unit if e[0] == "alloc"] for unit in units]
    place = [{key: p for p, key in enumerate(keys)} for keys in made]
    second, third = units[1], units[2]
    if len(second) != len(third) or len(made[1]) != len(made[2]):
        raise NotExtendable("the third pass runs other events than the second")
    # How each storage a third-pass event names follows from the second pass's: the same storage,
    # the third pass's own in place of the second's, or the second's in place of the first's.
    plan = []
    for e2, e3 in zip(second, third):
        fields = _KEY_FIELDS.get(e2[0], ())
        if e2[0] != e3[0] or len(e2) != len(e3) or any(e2[k] != e3[k] for k in range(len(e2)) if k not in fields):
            raise NotExtendable("the third pass runs other events than the second")
        roles = {}
        for k in fields:
            a, b = e2[k], e3[k]
            if a == b and a not in place[1] and a not in place[2]:
                roles[k] = ("same", a)
            elif a in place[1] and place[2].get(b) == place[1][a]:
                roles[k] = ("own", place[1][a])
            elif a in place[0] and place[1].get(b) == place[0][a]:
                roles[k] = ("previous", place[0][a])
            else:
                raise NotExtendable("a storage of the third pass does not follow from the second's")
        plan.append((e3, roles))
    tail = events[end:]
    if any(e[k] in place[1] for e in tail for k in _KEY_FIELDS.get(e[0], ())):
        raise NotExtendable("a storage of the second pass lives into the optimizer step")
    next_key = 1 + max(e[1] for e in events if e[0] == "alloc")
    out = events[:end]
    previous = made[2]
    for _ in range(passes - TRACED):
        own = list(range(next_key, next_key + len(previous)))
        next_key += len(own)
        for event, roles in plan:
            out.append(_renamed(event, roles, own, previous))
        previous = own
    last = {key: previous[p] for key, p in place[2].items()}
    out += [tuple(last.get(e[k], e[k]) if k in _KEY_FIELDS.get(e[0], ()) else e[k] for k in range(len(e)))
            for e in tail]
    return out


def _renamed(event: tuple, roles: dict, own: list, previous: list) -> tuple:
    if not roles:
        return event
    fields = list(event)
    for k, (role, value) in roles.items():
        fields[k] = value if role == "same" else own[value] if role == "own" else previous[value]
    return tuple(fields)


__all__ = ["TRACED", "NotExtendable", "extended"]
