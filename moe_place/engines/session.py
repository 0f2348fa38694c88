"""One model's rebalance rule inside an engine: the rule, its state between the engine's calls, the cadence.

Both adapters hold one `RuleSession` per model (vLLM's policy: in the policy state vLLM keeps, or with the
policy class for vLLM 0.33's classmethod interface; SGLang's hook: on the hook) and answer each engine call
with `RuleSession.decide`, which returns the map to run and the session the next call starts from. The
session it read is left as it was, so an engine may plan twice from one session (vLLM's context interface
plans from a state that changes only when a plan is committed).

With the per-batch split on (`MOE_PLACE_SPLIT=per-batch`, `moe_place.engines.batch_split`) the rule also makes
the split's per-layer choice (`RebalanceRule.split`) at each call, on the map the engine will run, priced
against the engine's own replica choice where the split is off; `split_layers` is its answer (the adapters
offer it to the forward pass). The replay's controller (`moe_place.online.controller.RuleController`) calls
the same `RebalanceRule.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moe_place.engines.config import EngineConfig, EngineModel, first_call_line, log_first_call
from moe_place.online.policy import RebalanceRule, RuleState
from moe_place.online.splitting import SplitChoice
from moe_place.placement import Placement

__all__ = ["RuleSession"]


@dataclass(frozen=True)
class RuleSession:
    """The rule of one model, its state, and the cadence it runs at.

    interval: steps (vLLM) or passes (SGLang) between the engine's calls. window_steps: steps in the
    engine's load window. engine: what the engine said about the model (None: it did not say).
    calls: calls answered.
    """

    rule: RebalanceRule
    state: RuleState
    interval: int
    window_steps: int
    engine: EngineModel | None = None
    calls: int = 0

    @classmethod
    def start(cls, config: EngineConfig, engine_name: str, engine: EngineModel | None, interval: int, window: int,
              cadence: str, num_gpus: int, num_nodes: int, num_layers: int, num_experts: int,
              num_groups: int | None, migration: str | None, split: str | None = None) -> "RuleSession":
        """A fresh session for one model (`EngineConfig.rule`), logging the line that says what the rule
        understood of the engine's setting (`cadence`: how the engine calls it, in words).

        split: with the per-batch split on, the engine's own replica choice where the split is off (a name of
        `moe_place.cost.replicas.REPLICA_CHOICES`); None: the split is off."""
        rule = config.rule(num_gpus, num_nodes, num_layers, num_experts, num_groups, engine=engine,
                           migration=migration)
        if split is not None:
            rule = replace(rule, split=SplitChoice(replace(rule.cost, replica_choice=split)))
        line = first_call_line(engine_name, rule, engine, config, cadence)
        log_first_call(line + ("" if split is None else f"; per-batch split where it pays (else {split})"))
        return cls(rule, rule.create_state(), interval, window, engine)

    def decide(self, window: np.ndarray, current: Placement,
               window_steps: int | None = None) -> tuple[Placement, "RuleSession"]:
        """(the map to run next: the rule's new map or `current`, the session after this call).

        window: the engine's window (`RebalanceRule.decide`); window_steps: the steps a summed window covers."""
        answer = self.rule.decide(self.state, window, current, self.interval, window_steps,
                                  step=self.calls * self.interval)
        placement = current if answer.decision is None else answer.decision.placement
        return placement, replace(self, state=answer.state, calls=self.calls + 1)

    @property
    def split_layers(self) -> np.ndarray | None:
        """bool `[layers]`: the layers the split should take after the last call (None: split off, or no call yet)."""
        return None if self.state.split is None else self.state.split.on
