"""Log lines that always say which switch, phase, rank and step they are about."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger("dist_quant.coordinator")


class SwitchLog(logging.LoggerAdapter):
    """Prefixes every message with `[switch=.. phase=.. rank=.. step=..]` and sets the same
    values as record attributes (`switch_id`, `phase`, `rank`, `step`) for structured handlers."""

    def __init__(self, rank: int | None) -> None:
        super().__init__(logger, {"rank": "coordinator" if rank is None else rank})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        fields = {
            "switch_id": kwargs.pop("switch_id", None),
            "phase": kwargs.pop("phase", None),
            "rank": self.extra["rank"],
            "step": kwargs.pop("step", None),
        }
        kwargs["extra"] = {**fields, **kwargs.get("extra", {})}
        prefix = " ".join(
            f"{k.removesuffix('_id')}={'-' if v is None else v}" for k, v in fields.items()
        )
        return f"[{prefix}] {msg}", kwargs
