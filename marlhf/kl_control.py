"""Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

After each PPO step the coefficient moves towards the one that keeps the policy's KL to the reference at
`target`:

    e = clip(KL / target - 1, -0.2, 0.2),    kl_coef <- kl_coef * (1 + e * n / horizon)

where KL is the step's mean over responses of the summed per-token KL estimate (`objective/kl`) and n the
number of responses in the step (all processes). The 0.2 clip bounds a step's change; `horizon` (in responses)
sets how fast it reacts: the coefficient can change by a factor of about exp(0.2 n steps / horizon) over `steps`
steps. TRL's `AdaptiveKLController` and OpenRLHF's follow the same rule. Two guards they lack: the coefficient
never exceeds `kl_coef_max`, and it stays as it is after a step whose policy learning rate is 0 (a policy that
cannot move towards the target would otherwise drive it up without end: a tuning run whose policy was frozen took
it from 0.24 to 7.8e7).

The coefficient is part of a run's state: PPO saves it with the checkpoint (like a learning-rate scheduler)
so that a resumed run continues with the coefficient the interrupted one had reached.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from marlhf.config import option

__all__ = ["AdaptiveKLController", "AdaptiveKLOptions"]

MAX_PROPORTIONAL_ERROR = 0.2


@dataclasses.dataclass
class AdaptiveKLOptions:
    """The adaptive KL controller's options, the one home of their declarations: PPOConfig holds their values in
    its block `kl_control_options`, reads them as `config.kl_control` and takes each flat too (`--kl_target 6`;
    marlhf.trainers.ppo_config.BLOCKS). The coefficient's start value (or fixed value) is PPOConfig.kl_coef."""

    kl_target: float | None = option(
        None, "adapt the KL coefficient after every step towards this KL (objective/kl), starting from kl_coef "
              "(Ziegler et al. 2019; none: kl_coef stays fixed); logged as objective/kl_coef, kept in checkpoints",
        gt=0)
    kl_horizon: int = option(10000, "kl_target: the controller's horizon in responses (smaller reacts faster; "
                                    "must exceed 0.2 x the responses per step)", ge=1)
    kl_coef_max: float = option(10.0, "kl_target: the largest value the adapted coefficient may take (it must be >= "
                                      "kl_coef)", gt=0)


class AdaptiveKLController:
    """The KL coefficient, adapted towards a KL target; `value` is the coefficient for the next step, at most
    `max_value` (PPO passes kl_coef_max; by default no bound)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int, responses_per_step: int,
                 max_value: float = math.inf) -> None:
        if not init_kl_coef > 0 or math.isinf(init_kl_coef):
            raise ValueError(f"an adaptive KL coefficient must start finite and > 0 (kl_coef), got {init_kl_coef}")
        if not init_kl_coef <= max_value:
            raise ValueError(f"kl_coef ({init_kl_coef}) is above the adaptive coefficient's bound kl_coef_max "
                             f"({max_value}): raise kl_coef_max or lower kl_coef")
        if not target > 0 or math.isinf(target):
            raise ValueError(f"`kl_target` must be a finite number > 0, got {target}")
        if not horizon > MAX_PROPORTIONAL_ERROR * responses_per_step:
            # else one step below target could make the coefficient 0 or negative
            raise ValueError(f"`kl_horizon` must be > {MAX_PROPORTIONAL_ERROR} x the responses per step "
                             f"({responses_per_step}), got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)
        self.responses_per_step = int(responses_per_step)
        self.max_value = float(max_value)

    def update(self, kl: float, learning_rate: float) -> float:
        """Move the coefficient after a step whose mean summed KL was `kl`, up to `max_value`; `learning_rate`
        is the policy's for its next update, through which the new coefficient acts. A NaN KL, or a learning
        rate of 0 (the policy cannot move towards the target), leaves it as it was. Returns the new value."""
        if math.isnan(kl) or learning_rate == 0:
            return self.value
        error = min(max(kl / self.target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        self.value = min(self.value * (1.0 + error * self.responses_per_step / self.horizon), self.max_value)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
