"""A one-turn environment whose reward and info are fixed in advance, for tests that need to know exactly
which episodes are right (rollout generation, evaluation) whatever the tiny model writes."""

from __future__ import annotations

from copc.types import EnvStep, Prompt, StopReason


class ScriptedEnv:
    """Ends after the first turn (or when the loop stops it) with ``reward``, ``correct`` = reward and
    the ``extra`` info (e.g. ``tool_infra_errors``)."""

    def __init__(self, prompt: Prompt, reward: float, extra: dict[str, float] | None = None) -> None:
        self.prompt, self.reward, self.extra = prompt, reward, extra or {}

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return ("\n",)

    def initial_text(self) -> str:
        return self.prompt.text

    def step(self, action_text: str) -> EnvStep:
        return EnvStep(observation=None, done=True, reward=self.reward, info={"correct": self.reward,
                                                                              **self.extra})

    def finish(self, reason: StopReason) -> EnvStep:
        return self.step("")
