"""How a recorded trajectory splits into policy turns, and each turn as the engine produced it.

Replaying a recorded episode (:func:`copc.rollout.episode.continue_episodes`) must cut its policy tokens
into the same turns the episode loop sampled and hand the environment the same text. A turn ends at the
first token that completes one of the env's stop strings (:meth:`Engine.completed_stop`, the rule the
engine stops a row by) or at an end-of-sequence token; two turns with no observation between them are
still told apart that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from copc.rollout.engine import Engine, FinishReason, Generation
from copc.types import Trajectory

__all__ = ["ReplayError", "boundary_lengths", "recorded_turn", "turn_end"]


class ReplayError(ValueError):
    """A recorded prefix could not be replayed: its environment answered differently this time."""


def boundary_lengths(engine: Engine, trajectory: Trajectory, stop_strings: Sequence[str]) -> list[int]:
    """Token lengths of ``trajectory`` at its turn boundaries: the prompt, then the end of each policy turn's
    observation (or of the turn, when no observation followed), one entry per policy turn after the prompt.

    A turn ends at the first token that completes one of ``stop_strings`` (the env's) or at an EOS, as it
    did when it was sampled, so two turns with no observation between them are still told apart.
    """
    ids = trajectory.token_ids.tolist()
    mask = trajectory.action_mask.tolist()
    out, pos = [trajectory.prompt_len], trajectory.prompt_len
    while pos < len(ids):
        if not mask[pos]:
            pos += 1
            continue
        end = turn_end(engine, ids, mask, pos, stop_strings)
        while end < len(ids) and not mask[end]:
            end += 1
        out.append(end)
        pos = end
    return out


def turn_end(engine: Engine, ids: list[int], mask: list[bool], start: int, stops: Sequence[str]) -> int:
    """Index just past the policy turn that starts at ``start`` (its stop string, EOS, or its last token)."""
    end = start
    while end < len(ids) and mask[end]:
        end += 1
        if ids[end - 1] in engine.eos_token_ids or engine.completed_stop(ids[start:end],
                                                                         tuple(stops)) is not None:
            return end
    return end


def recorded_turn(engine: Engine, tokens: list[int], prefix: Trajectory, start: int,
                  stops: Sequence[str]) -> Generation:
    """The :class:`Generation` that sampled ``tokens`` (recorded log-probs and versions, its stop)."""
    eos = bool(tokens) and tokens[-1] in engine.eos_token_ids
    text = str(engine.tokenizer.decode(tokens[:-1] if eos else tokens, skip_special_tokens=False))
    stop = None if eos else engine.completed_stop(tokens, tuple(stops))
    end = slice(start, start + len(tokens))
    return Generation(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        logp=prefix.logp_behav[end].clone(),
        versions=prefix.policy_version[end].clone(),
        text=text,
        finish=FinishReason.EOS if eos else FinishReason.STOP if stop else FinishReason.LENGTH,
        stop_string=stop[0] if stop else None,
        stop_end=stop[1] if stop else None,
    )
