"""Each node's free resources, from the Ray dashboard's node summary.

Ray's HTTP APIs give a node's totals (the state API) but not what is free; the dashboard's
`/nodes?view=summary` carries it as the autoscaler's per-node usage lines (what `ray status
-v` prints), which the monitor refreshes every few seconds:

    0.0/3.0 CPU (0.0 used of 2.0 reserved in placement groups)
    1.0/1.0 GPU

Ray writes them with `parse_usage` (ray/autoscaler/_private/util.py): the first number is
what tasks use, with a placement group's reservation replaced by what runs inside it, so a
node's allocated amount is `used - pg_used + pg_total`, and what is free is the total less
that. Memory lines ("0B/15.56GiB memory") are skipped: no run asks for memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Ray prints Python floats: `used` (less what placement groups reserve) may come out as
# "-5.551115123125783e-17" when fractional reservations do not sum exactly.
_NUMBER = r"[-+]?[\d.]+(?:[eE][-+]?\d+)?"
_USAGE_LINE = re.compile(
    rf"^(?P<used>{_NUMBER})/(?P<total>{_NUMBER}) (?P<name>\S+)"
    rf"(?: \((?P<pg_used>{_NUMBER}) used of (?P<pg_total>{_NUMBER}) reserved in placement "
    r"groups\))?$"
)
SKIPPED = frozenset({"memory", "object_store_memory"})


def free(usage_text: str) -> dict[str, float]:
    """What a node's usage lines say is free, by resource name (Ray's own names: the
    summary's other fields have theirs camel-cased)."""
    left: dict[str, float] = {}
    for line in usage_text.splitlines():
        match = _USAGE_LINE.match(line.strip())
        if match is None or match["name"] in SKIPPED:
            continue
        taken = float(match["used"])
        if match["pg_total"] is not None:
            taken += float(match["pg_total"]) - float(match["pg_used"])
        left[match["name"]] = max(float(match["total"]) - taken, 0.0)
    return left


def free_by_node(summary: Mapping[str, Any]) -> list[dict[str, float]]:
    """Each node's free resources from the `data` of `/nodes?view=summary`. The usage covers
    the nodes the monitor saw alive; one that joined seconds ago is left out until the
    next report, as if full. Raises ValueError when no node's usage is reported."""
    usage = summary.get("nodeLogicalResources") or {}
    if not usage:
        # The dashboard sends none while the monitor has not reported or reports an error:
        # not known, rather than a cluster without free resources that holds every run.
        raise ValueError("the dashboard reports no node's usage yet")
    return [free(text) for _, text in sorted(usage.items())]
