"""Rendered episodes for people: what the model wrote, what the tools answered, reward and stop reason.

:func:`render_episode` cuts a :class:`~copc.types.Trajectory` at its ``action_mask`` boundaries, so each
piece is exactly what the model sampled (``"policy"``) or what was inserted (``"forced"``: tool output
with any chat-template tokens around it), decoded with special tokens kept. :func:`append_samples`
writes them as JSON lines, e.g. ``copc eval --samples-out FILE``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from copc.types import Trajectory

__all__ = ["append_samples", "render_episode"]


def render_episode(traj: Trajectory, tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """``{prompt_id, prompt, turns: [{source: policy|forced, text}], reward, stop_reason, truncated,
    info}``."""
    ids, mask = traj.token_ids.tolist(), traj.action_mask.tolist()
    pieces: list[tuple[bool, list[int]]] = []
    for token, sampled in zip(ids[traj.prompt_len :], mask[traj.prompt_len :], strict=True):
        if pieces and pieces[-1][0] == sampled:
            pieces[-1][1].append(token)
        else:
            pieces.append((sampled, [token]))

    def text(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=False))

    return {
        "prompt_id": traj.prompt_id,
        "prompt": text(ids[: traj.prompt_len]),
        "turns": [{"source": "policy" if sampled else "forced", "text": text(tokens)} for sampled,
                  tokens in pieces],
        "reward": traj.reward,
        "stop_reason": traj.stop_reason.value,
        "truncated": traj.truncated,
        "info": dict(traj.info),
    }


def append_samples(
    path: str | Path, trajectories: Sequence[Trajectory], tokenizer: PreTrainedTokenizerBase, *, step: int,
    limit: int
) -> int:
    """Append the first ``limit`` episodes, rendered, as JSON lines tagged with ``step``; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chosen = list(trajectories[:limit])
    with path.open("a") as out:
        for traj in chosen:
            out.write(json.dumps({"step": step, **render_episode(traj, tokenizer)}) + "\n")
    return len(chosen)
