"""Graceful drain of one replica: `Retire`, and what is left at shutdown.

A retired proxy hands its engine back without dropping anything: new attempts start on
another replica's engine at once (through `ContinueGeneration`, as a migration with no
tokens yet), the requests already on its engine get the drain timeout to finish, and those
still running then are aborted there and move on with the tokens they have. The proxy
stays: it owns its sessions' recordings, so turns of sessions pinned to it, their rewards
and exports keep working, generated elsewhere. It reports `draining` (and `retired`) to the
router, which then sends it only the turns of sessions pinned to it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_proxy.generation.controller import GenerationController
    from areal_proxy.generation.migration import Migrator

log = logging.getLogger(__name__)

# How often the drain looks at what is left on the engine (cheap: a set's length).
_POLL_S = 0.05
# How long evacuated requests may take to leave the engine (an abort is answered at once;
# an engine that does not answer it is about to be stopped anyway).
_EVACUATE_S = 10.0
# Outcomes of a migration decision that leave the request failed.
_REFUSALS = ("refused_constraint", "refused_n", "refused_limit", "no_peer")


@dataclass(frozen=True)
class Drained:
    finished: int  # finished on the engine during the drain
    moved: int  # still on the engine at the timeout: aborted there to move on
    failed: int  # moves refused during the drain (they failed `migration_failed`)

    @property
    def message(self) -> str:
        return (
            f"retired: {self.finished} request(s) finished on the engine, {self.moved} moved "
            f"to other replicas, {self.failed} could not move"
        )


async def _settled(controller: GenerationController, within: float) -> bool:
    """Wait until nothing runs on the engine; False if `within` seconds passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while controller.on_engine:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


def _refused(migrator: Migrator | None) -> int:
    if migrator is None:
        return 0
    return sum(migrator.counts.get(o, 0) for o in _REFUSALS)


async def drain(controller: GenerationController, grace: float) -> Drained:
    """Retire `controller` and empty its engine: the requests on it get `grace` seconds,
    then the rest are moved. Returns once nothing runs there."""
    refused = _refused(controller.migrator)
    controller.retire()
    started = controller.on_engine
    log.info("draining %d request(s) off the engine for up to %gs", started, grace)
    moved = 0
    if not await _settled(controller, max(0.0, grace)):
        moved = await controller.evacuate()
        log.info("drain timeout: %d request(s) moved off the engine", moved)
        if not await _settled(controller, _EVACUATE_S):
            log.warning("%d request(s) still on the engine after their abort", controller.on_engine)
    out = Drained(
        finished=max(0, started - moved),
        moved=moved,
        failed=_refused(controller.migrator) - refused,
    )
    log.info("%s", out.message)
    return out
