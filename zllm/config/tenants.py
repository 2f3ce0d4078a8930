"""Who a request is for: its tenant, and how much of the engine each tenant is owed.

    API keys set (--api-key K1 --api-key K2)   the key's tenant: "key-1", "key-2" (the key's
                                               position; the key itself is a secret and never
                                               becomes a name or a metrics label)
    otherwise, an `X-Tenant: <name>` header    that name
    otherwise                                  "default"

`--scheduling-policy fair` shares the engine between tenants in proportion to their weights
(`--tenant-weights key-1=3,alice=2`; 1 for a tenant not listed): core/fair_share.py. Under
every policy the core counts each tenant's requests and tokens for /metrics.

--tenant-weights also takes a tenant's own door limits, which replace the global
--tenant-max-concurrency / --tenant-max-requests-per-second for it (frontend/access/tenant_limits.py):

    {"key-1": {"weight": 3, "max_concurrency": 4, "max_requests_per_second": 10}, "alice": 2}

A weight needs the fair policy; limits alone do not (a tenant without a weight weighs 1).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping

import msgspec

from zllm.errors import ParamError

TENANT_HEADER = "x-tenant"
MAX_TENANT_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def api_key_tenant(key_index: int) -> str:
    """The tenant of the API key at `key_index` (0-based) in the --api-key list."""
    return f"key-{key_index + 1}"


def check_tenant_name(name: str, param: str = "X-Tenant") -> str:
    """A tenant name as a header or --tenant-weights gives it: 1-64 characters of letters,
    digits and `_ . : @ -` (it becomes a metrics label)."""
    if not 0 < len(name) <= MAX_TENANT_CHARS or not _NAME.match(name):
        raise ParamError(
            f"{param} must be 1-{MAX_TENANT_CHARS} characters of letters, digits and "
            f"'_.:@-', got {name[: MAX_TENANT_CHARS + 8]!r}",
            param,
        )
    return name


class TenantLimit(msgspec.Struct, frozen=True, omit_defaults=True):
    """One tenant's own limits at the door (frontend/access/tenant_limits.py); None: the global
    flag's (--tenant-max-concurrency, --tenant-max-requests-per-second)."""

    max_concurrency: int | None = None
    max_requests_per_second: float | None = None


class TenantPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One tenant's entry in --tenant-weights: a plain number is its weight; an object may
    give its weight (fair share, in the core) and its own limits (at the door) beside it."""

    weight: float | None = None
    max_concurrency: int | None = None
    max_requests_per_second: float | None = None

    @property
    def limit(self) -> TenantLimit | None:
        if self.max_concurrency is None and self.max_requests_per_second is None:
            return None
        return TenantLimit(self.max_concurrency, self.max_requests_per_second)


def check_tenant_policies(entries: Mapping[str, object]) -> dict[str, TenantPolicy]:
    """--tenant-weights as the CLI or the Python API gives it (each value a number, a
    TenantPolicy or an object of its fields): names checked, every number positive and
    finite, max_concurrency an integer."""
    checked = {}
    for name, entry in entries.items():
        check_tenant_name(str(name), "tenant_weights")
        checked[str(name)] = _policy(str(name), entry)
    return checked


def _policy(name: str, entry: object) -> TenantPolicy:
    def refuse(detail: str) -> ParamError:
        return ParamError(f"tenant_weights: {name!r}: {detail}, got {entry!r}", "tenant_weights")

    if isinstance(entry, TenantPolicy):
        policy = entry
    elif isinstance(entry, Mapping):
        try:
            policy = msgspec.convert(entry, TenantPolicy)
        except msgspec.ValidationError as e:
            fields = "fields: weight, max_concurrency, max_requests_per_second"
            raise refuse(f"{e} ({fields})") from None
    else:
        try:
            policy = TenantPolicy(weight=float(entry))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise refuse("the weight must be a positive number") from None
    for field in ("weight", "max_concurrency", "max_requests_per_second"):
        value = getattr(policy, field)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise refuse(f"{field} must be a positive number")
    if isinstance(policy.max_concurrency, float):  # a TenantPolicy made in Python
        raise refuse("max_concurrency must be an integer")
    return policy


def parse_tenant_weights(text: str) -> dict[str, TenantPolicy]:
    """`--tenant-weights`: `name=weight,...`, or a JSON object whose values are weights or
    objects with weight, max_concurrency and max_requests_per_second."""
    text = text.strip()
    try:
        if text.startswith("{"):
            entries = json.loads(text)
            if not isinstance(entries, dict):
                raise ValueError
        else:
            entries = {}
            for item in filter(None, (part.strip() for part in text.split(","))):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError
                entries[name.strip()] = value.strip()
        return check_tenant_policies(entries)
    except (ValueError, ParamError) as e:
        detail = f": {e}" if isinstance(e, ParamError) else ""
        raise argparse.ArgumentTypeError(
            f"expected name=weight pairs separated by commas (key-1=3,alice=1.5) or a JSON "
            f'object ({{"key-1": {{"weight": 3, "max_concurrency": 4}}, "alice": 1.5}}), got '
            f"{text!r}{detail}"
        ) from None


def tenant_weights_of(flag: dict | None, scheduling_policy: str) -> dict[str, float]:
    """--tenant-weights' weights (fair-share scheduling needs --scheduling-policy fair)."""
    policies = check_tenant_policies(flag or {})
    weights = {n: p.weight for n, p in policies.items() if p.weight is not None}
    if weights and scheduling_policy != "fair":
        raise ValueError(
            "--tenant-weights needs --scheduling-policy fair for weights (a tenant's "
            "limits alone do not)"
        )
    return weights


def tenant_limits_of(flag: dict | None) -> dict[str, TenantLimit]:
    """--tenant-weights' per-tenant limits (the frontend's door reads them)."""
    policies = check_tenant_policies(flag or {})
    return {n: p.limit for n, p in policies.items() if p.limit is not None}
