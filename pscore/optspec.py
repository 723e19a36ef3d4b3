"""An optimizer from its spec (its name and hyper-parameters as doubles, the form the wire
carries) and what each push says beside its gradients (``StepOptions``): which optimizer every
parameter group runs for one update. The math is in ``pscore/optim.py``; the messages that
carry both are ``pswire.jobspec`` and ``pswire.write``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from pscore.optim import OPTIMIZERS, Optimizer
from pscore.outer import OUTER_OPTIMIZERS
from pswire.errors import InvalidRequestError


def optimizer_from_spec(name: str, params: Mapping[str, float]) -> Optimizer:
    """Builds an optimizer from its wire form.

    Raises:
        InvalidRequestError: unknown optimizer, unknown or invalid hyper-parameter.
    """
    cls = OPTIMIZERS.get(name) or OUTER_OPTIMIZERS.get(name)
    if cls is None:
        raise InvalidRequestError(
            f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)} or an outer "
            f"optimizer {sorted(OUTER_OPTIMIZERS)}"
        )
    try:
        return cls(**_kwargs(cls, params))
    except ValueError as exc:
        raise InvalidRequestError(f"optimizer {name!r}: {exc}") from exc


def with_values(base: Optimizer, values: Mapping[str, float], where: str = "") -> Optimizer:
    """``base`` with some hyper-parameters replaced (an lr a scheduler changed, ...).

    Raises:
        InvalidRequestError: an unknown or invalid value, or one that would change which
            optimizer slots exist (``layout``: e.g. momentum switched on), naming ``where``.
    """
    if not values:
        return base
    prefix = f"{where}: " if where else ""
    try:
        changed = replace(base, **_kwargs(type(base), values))
    except (ValueError, InvalidRequestError) as exc:
        raise InvalidRequestError(f"{prefix}optimizer {base.name!r}: {exc}") from exc
    if changed.layout() != base.layout():
        diff = {k: v for k, v in changed.params().items() if base.params()[k] != v}
        raise InvalidRequestError(
            f"{prefix}optimizer {base.name!r}: {diff} would change which optimizer state "
            f"exists (was {base.params()}); that is fixed when the job starts"
        )
    return changed


def _kwargs(cls: type[Optimizer], params: Mapping[str, float]) -> dict[str, Any]:
    """Constructor arguments from wire values (doubles), checked.

    Raises:
        InvalidRequestError: unknown name, non-finite value, a flag that is not 0 or 1.
    """
    name = cls.name
    known = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in known:
            raise InvalidRequestError(
                f"optimizer {name!r} has no parameter {key!r}; expected one of {sorted(known)}"
            )
        if not np.isfinite(value):
            raise InvalidRequestError(f"optimizer {name!r} parameter {key!r} is {value}")
        if known[key] in (bool, "bool"):
            # The wire carries doubles: a flag is 0 or 1, anything else is a mistake, not True.
            if value not in (0, 1):
                raise InvalidRequestError(
                    f"optimizer {name!r} parameter {key!r} is a flag, got {value}; expected 0 or 1"
                )
            kwargs[key] = bool(value)
        else:
            kwargs[key] = float(value)
    return kwargs


@dataclass(frozen=True)
class StepOptions:
    """What a push says beside its gradients.

    ``values``: per parameter group (index), hyper-parameters that replace the job's for this
    update (an lr a scheduler set, ...); groups and names left out keep the job's values.
    ``skip``: this worker's step is skipped (a GradScaler found inf/NaN in its gradients):
    the push carries no gradients (buffers only), and no optimizer step is taken with it (in
    ``sync``, none for that step at all).
    """

    values: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    skip: bool = False


NO_OPTIONS = StepOptions()


def group_optimizers(
    groups: Sequence[Optimizer], options: StepOptions | None
) -> tuple[Optimizer, ...]:
    """Each parameter group's optimizer for one update: ``groups`` with ``options.values``.

    Raises:
        InvalidRequestError: a group index out of range, or a bad value (naming the group).
    """
    out = tuple(groups)
    if options is None or not options.values:
        return out
    changed = list(out)
    for index, values in options.values.items():
        if not 0 <= index < len(out):
            raise InvalidRequestError(
                f"hyper-parameters for parameter group {index}; the job has groups "
                f"0..{len(out) - 1}"
            )
        changed[index] = with_values(out[index], values, f"parameter group {index}")
    return tuple(changed)


def resolve_groups(
    optimizer: Optimizer | Sequence[Optimizer],
    groups: Mapping[str, int] | None,
    names: Sequence[str],
) -> tuple[tuple[Optimizer, ...], dict[str, int]]:
    """(every group's optimizer, each of ``names``' group) from what a worker's ``init`` got:
    one optimizer, or one per parameter group (of any classes: two models' optimizers in one
    job), and the groups of some names (others: 0).

    Raises:
        InvalidRequestError: no optimizer, a group for a name the model lacks or out of
            range.
    """
    optimizers = (optimizer,) if isinstance(optimizer, Optimizer) else tuple(optimizer)
    if not optimizers:
        raise InvalidRequestError("no optimizer: give one, or one per parameter group")
    given = dict(groups or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidRequestError(f"parameter groups name {unknown}, which the model lacks")
    bad = {n: g for n, g in given.items() if not 0 <= g < len(optimizers)}
    if bad:
        raise InvalidRequestError(
            f"parameter groups {bad} out of range: there are {len(optimizers)} optimizers"
        )
    return optimizers, {n: given.get(n, 0) for n in names}
