"""copc's policy loss through verl's own actor loss, ``verl.workers.utils.losses.ppo_loss``.

Real verl code: ``ppo_loss`` (it reads ``rollout_is_weights`` out of the batch, fills
``config.global_batch_info`` and looks the loss up in its registry), ``FSDPActorConfig``,
``left_right_2_no_padding`` (the trainer's padded -> no-padding conversion before an actor update),
``prepare_micro_batches`` (the engine's micro-batch split), ``no_padding_2_padding`` (inside
``ppo_loss``) and ``construct_minimal_padding_template`` (the synthetic padding rows verl's v1 trainer
appends to make a batch divisible by the data-parallel size). copc's side is the plugin's own
``copc_advantage_step`` (omega and advantages) and copc's ``copc_policy_loss`` as the reference.

Stand-ins: the model. ``model_output["log_probs"]`` is built by hand as the FSDP engine returns it (a
jagged tensor over prompt + response tokens, each response log-prob one position left of its token),
from a leaf ``[B, T]`` tensor so the gradient can be compared; the engine's ``batch_num_tokens`` and
``dp_size`` are assigned as ``FSDPEngine.forward_backward_batch`` assigns them (one rank). The FSDP engine
itself runs in ``test_verl_fsdp_workers.py``.

Tolerances: both sides compute the same float32 per-token formula; verl sums the loss per micro-batch and
the micro-batch losses are added (gradient accumulation), copc sums once over the whole mini-batch, so
results differ only by float32 summation order: rtol 1e-6, atol 1e-7 (losses are O(1), gradients O(1/N)).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds .venv-verl)")
pytestmark = pytest.mark.verl

from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.padding_utils import construct_minimal_padding_template  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import copc.integrations.verl as plugin  # noqa: E402
from copc.channels import PolicyInputs, policy_loss  # noqa: E402
from copc.channels.methods import get_method  # noqa: E402
from copc.integrations.verl_config import CopcChannels  # noqa: E402
from copc.ops import AggSpec, ClipSpec, CorrectedInputs, copc_policy_loss  # noqa: E402

RTOL, ATOL = 1e-6, 1e-7
EOS = 2
CHANNELS = CopcChannels(get_method("copc").policy, get_method("copc").advantage)


def _rows(seed: int, n: int) -> list[dict[str, torch.Tensor]]:
    """Unpadded samples as TransferQueue holds them (1-D per field); row 1 is multi-turn (a tool span)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p, r = int(torch.randint(2, 6, (), generator=g)), int(torch.randint(3, 9, (), generator=g))
        mask = torch.ones(r, dtype=torch.int64)
        if i == 1:
            r = 8
            mask = torch.ones(r, dtype=torch.int64)
            mask[3:6] = 0
        old = -3.0 * torch.rand(r, generator=g)
        rows.append({
            "prompts": torch.randint(3, 50, (p,), generator=g),
            "responses": torch.randint(3, 50, (r,), generator=g),
            "response_mask": mask,
            "rm_scores": torch.zeros(r).index_fill_(0, torch.tensor([r - 1]),
                                                    float(torch.rand((), generator=g) > 0.5)),
            "old_log_probs": old,
            "rollout_log_probs": old + 0.6 * torch.randn(r, generator=g),
            "values": torch.randn(r, generator=g),
            # the current policy: near old, every 5th token far away (so clips and the band bind)
            "log_prob": old + 0.2 * torch.randn(r, generator=g) + 1.5 * (torch.arange(r) % 5 == 0),
        })
    return rows


def _padding_row(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """verl's own synthetic padding sample (response of one EOS, response_mask 0), with the per-token
    numbers a model and the advantage step would give it (old and current log-probs are real numbers)."""
    row, _ = construct_minimal_padding_template(dict(source), {}, EOS)
    return {k: row[k] for k in ("prompts", "responses", "response_mask", "rm_scores",
                                "rollout_log_probs")} | {
        "old_log_probs": torch.tensor([-35.0]), "values": torch.tensor([0.3]),
        "log_prob": torch.tensor([-33.0]),
    }


def _pad(rows: list[dict[str, torch.Tensor]], key: str, width: int, left: bool = False) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=rows[0][key].dtype)
    for i, row in enumerate(rows):
        n = len(row[key])
        if left:
            out[i, width - n :] = row[key]
        else:
            out[i, :n] = row[key]
    return out


def verl_actor_batch(
    rows: list[dict[str, torch.Tensor]], channels: CopcChannels = CHANNELS
) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """The actor-update batch as verl's trainer builds it (left-padded prompts, right-padded responses,
    what the plugin's advantage step writes: advantages and, for R0, omega; for R1 ``old_log_probs = mu``),
    converted by verl's own ``left_right_2_no_padding``; also the padded tensors for copc's reference."""
    P, T = max(len(r["prompts"]) for r in rows), max(len(r["responses"]) for r in rows)
    prompts, responses = _pad(rows, "prompts", P, left=True), _pad(rows, "responses", T)
    prompt_att = _pad([{"m": torch.ones(len(r["prompts"]), dtype=torch.int64)} for r in rows], "m", P,
                      left=True)
    resp_att = _pad([{"m": torch.ones(len(r["responses"]), dtype=torch.int64)} for r in rows], "m", T)
    attention_mask = torch.cat([prompt_att, resp_att], dim=1)
    padded = {k: _pad(rows, k, T) for k in ("response_mask", "rm_scores", "old_log_probs",
                                            "rollout_log_probs", "values", "log_prob")}
    step = plugin.copc_advantage_step(
        channels, token_level_rewards=padded["rm_scores"], values=padded["values"],
        old_log_probs=padded["old_log_probs"], rollout_log_probs=padded["rollout_log_probs"],
        response_mask=padded["response_mask"],
    )
    written = {"advantages": step.advantages}
    if step.rollout_is_weights is not None:
        written["rollout_is_weights"] = step.rollout_is_weights
    padded |= written
    td = TensorDict(
        {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": padded["response_mask"],
            "old_log_probs": padded["old_log_probs"] if step.old_log_probs is None else step.old_log_probs,
        } | written,
        batch_size=len(rows),
    )
    td = left_right_2_no_padding(td)
    # What the trainer's _update_actor and the FSDP engine's forward_backward_batch assign (one rank).
    tu.assign_non_tensor(td, global_batch_size=len(rows), use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)
    return td, padded


def engine_log_probs(micro: TensorDict, logp_BT: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The engine's ``log_probs`` output for a micro-batch: jagged over each row's prompt + response tokens,
    response token j's log-prob at position prompt_len + j - 1 (logits predict the next token)."""
    prompt_lens = micro["attention_mask"][:, : micro["prompts"].shape[1]].sum(-1)
    resp_lens = micro["attention_mask"][:, micro["prompts"].shape[1] :].sum(-1)
    pieces = []
    for b, p, r in zip(rows.tolist(), prompt_lens.tolist(), resp_lens.tolist(), strict=True):
        pieces += [torch.full((p - 1,), -7.0), logp_BT[b, :r], torch.full((1,), -7.0)]
    seq_lens = prompt_lens + resp_lens
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)


def verl_loss(td: TensorDict, logp_BT: torch.Tensor, actor: FSDPActorConfig):
    """Sum of verl's ``ppo_loss`` over the engine's micro-batches (gradient accumulation)."""
    micro_batches, _ = prepare_micro_batches(td)
    start, total, metrics = 0, torch.zeros(()), []
    for micro in micro_batches:
        rows = torch.arange(start, start + len(micro))
        start += len(micro)
        loss, m = ppo_loss(actor, {"log_probs": engine_log_probs(micro, logp_BT, rows)}, micro)
        total, metrics = total + loss, [*metrics, m]
    return total, metrics


def actor_config(mode: str) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=2, rollout_n=1, loss_agg_mode=mode,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, policy_loss={"loss_mode": "copc"},
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_copc_loss_through_verls_ppo_loss_equals_copcs_own_policy_loss(mode: str) -> None:
    rows = _rows(seed=0, n=6)
    td, padded = verl_actor_batch(rows)
    mask = padded["response_mask"].bool()
    logp = padded["log_prob"].clone().requires_grad_(True)
    loss, metrics = verl_loss(td, logp, actor_config(mode))
    ref_logp = padded["log_prob"].clone().requires_grad_(True)
    ref = copc_policy_loss(
        CorrectedInputs(ref_logp, padded["old_log_probs"], padded["rollout_log_probs"], padded["advantages"],
                        mask),
        mask_low=0.5, mask_high=2.0, clip=ClipSpec(0.2, 0.28, 3.0), agg=AggSpec(mode),
        # type: ignore[arg-type]
    )
    assert 0.0 < float(ref.stats["policy/mask_frac"]) < 1.0  # the band cuts some tokens and keeps others
    torch.testing.assert_close(loss, ref.loss, rtol=RTOL, atol=ATOL)
    loss.backward()
    ref.loss.backward()
    assert logp.grad is not None and ref_logp.grad is not None
    assert (logp.grad[mask] != 0).any() and (logp.grad[~mask] == 0).all()  # tool span and padding get nothing
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=RTOL, atol=ATOL)
    # copc's stats reach verl's metrics, under copc's names, in every micro-batch
    assert all({"copc/policy/mask_frac", "copc/policy/clip_frac_high",
                "actor/pg_loss"} <= set(m) for m in metrics)


def test_verls_padding_rows_give_no_nan_and_change_nothing() -> None:
    rows = _rows(seed=1, n=4)
    pads = [_padding_row(rows[0]) for _ in range(2)]
    td, padded = verl_actor_batch(rows + pads)  # micro-batches: 2 real, 2 real, 2 padding only
    assert int(td["loss_mask"][-2:].sum()) == 0
    logp = padded["log_prob"].clone().requires_grad_(True)
    loss, metrics = verl_loss(td, logp, actor_config("token-mean"))
    micro_losses = [float(m["actor/pg_loss"].values[0]) for m in metrics]
    assert micro_losses[-1] == 0.0  # the all-padding micro-batch: 0, not 0/0
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all() and torch.isfinite(loss)
    assert (logp.grad[-2:] == 0).all()
    assert all(math.isfinite(x) for m in metrics for v in m.values() if isinstance(v,
                                                                                   Metric) for x in v.values)
    # and the real rows' loss is what it is without the padding rows (token-mean: padding adds no tokens)
    td_real, padded_real = verl_actor_batch(rows)
    real, _ = verl_loss(td_real, padded_real["log_prob"], actor_config("token-mean"))
    torch.testing.assert_close(loss.detach(), real, rtol=RTOL, atol=ATOL)


# --- R1: verl's own bypass-mode loss, the trainer having written old_log_probs = mu ------------------------


def r1_actor_config(
    mode: str, rollout_rs: str | None = "token_k1", threshold: str = "0.5_2.0", scale: float | None = None,
    loss_mode: str = plugin.BEHAVIOUR_LOSS,
) -> FSDPActorConfig:
    correction = {"rollout_rs": rollout_rs, "rollout_rs_threshold": threshold if rollout_rs else None}
    return FSDPActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=2, rollout_n=1, loss_agg_mode=mode,
        loss_scale_factor=scale,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        policy_loss={"loss_mode": loss_mode, "rollout_correction": correction},
    )


NORM = 12.0  # seq-mean-token-sum-norm's constant (verl's loss_scale_factor, copc's norm_length)


@pytest.mark.parametrize(("mode", "preset", "threshold", "band"), [
    ("token-mean", "copc_behaviour", "0.5_2.0", (0.5, 2.0)),
    ("seq-mean-token-sum", "copc_behaviour", "0.5_2.0", (0.5, 2.0)),
    ("seq-mean-token-sum-norm", "copc_behaviour", "0.5_2.0", (0.5, 2.0)),
    ("token-mean", "copc_behaviour", "0.5_1.25", (0.8, 2.0)),  # asymmetric: verl's bounds are on mu/cur
    ("token-mean", "async_ppo_advantage", "", (0.0, math.inf)),
])
def test_r1_through_verls_bypass_mode_loss_equals_copcs_own_r1_policy_loss(
    mode: str, preset: str, threshold: str, band: tuple[float, float]
) -> None:
    """R1 (docs/formulas.md#r1) in verl is verl's bypass-mode loss on the batch copc's trainer wrote: copc's
    own ``copc_behaviour`` actor loss (band on cur/mu at every micro-batch, PPO clip on cur/mu, dual clip),
    and with no band (``rollout_rs=null``) async PPO 3a's, the advantage channel alone
    (``async_ppo_advantage``)."""
    method = get_method(preset)
    policy = dataclasses.replace(method.policy, mask_low=band[0], mask_high=band[1], loss_agg=mode,
                                 norm_length=NORM if mode.endswith("norm") else None)
    channels = CopcChannels(policy, method.advantage)
    assert channels.behaviour
    rows = _rows(seed=0, n=6)
    td, padded = verl_actor_batch(rows, channels)
    assert "rollout_is_weights" not in td
    mask = padded["response_mask"].bool()
    logp = padded["log_prob"].clone().requires_grad_(True)
    actor = r1_actor_config(mode, "token_k1" if threshold else None, threshold,
                            NORM if mode.endswith("norm") else None)
    loss, metrics = verl_loss(td, logp, actor)
    ref_logp = padded["log_prob"].clone().requires_grad_(True)
    ref = policy_loss(
        policy, PolicyInputs(ref_logp, None, padded["rollout_log_probs"], padded["advantages"], mask,
                             num_tokens=None),
    )
    kept = float(ref.stats["policy/mask_frac"]) if "policy/mask_frac" in ref.stats else 0.0
    assert (0.0 < kept < 1.0) if preset == "copc_behaviour" else kept == 0.0  # the band binds where it exists
    torch.testing.assert_close(loss, ref.loss, rtol=RTOL, atol=ATOL)
    loss.backward()
    ref.loss.backward()
    assert logp.grad is not None and ref_logp.grad is not None and (logp.grad[mask] != 0).any()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=RTOL, atol=ATOL)
    if preset == "copc_behaviour":  # verl's rejection metrics report the band in every micro-batch
        assert all("rollout_corr/rollout_rs_token_k1_masked_fraction" in m for m in metrics)


def test_r1_micro_batch_of_verls_padding_rows_gives_zero_not_an_error() -> None:
    """verl's rejection step raises on a micro-batch with no valid token; copc's ``copc_behaviour`` gives 0
    there, and the real rows' loss is what it is without the padding rows."""
    method = get_method("copc_behaviour")
    channels = CopcChannels(method.policy, method.advantage)
    rows = _rows(seed=1, n=4)
    td, padded = verl_actor_batch(rows + [_padding_row(rows[0]) for _ in range(2)], channels)
    assert int(td["loss_mask"][-2:].sum()) == 0
    logp = padded["log_prob"].clone().requires_grad_(True)
    loss, metrics = verl_loss(td, logp, r1_actor_config("token-mean"))
    assert float(metrics[-1]["actor/pg_loss"].values[0]) == 0.0
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all() and (logp.grad[-2:] == 0).all()
    td_real, padded_real = verl_actor_batch(rows, channels)
    real, _ = verl_loss(td_real, padded_real["log_prob"], r1_actor_config("token-mean"))
    torch.testing.assert_close(loss.detach(), real, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="at least one valid token"):  # verl's own loss, on the same batch
        verl_loss(td, padded["log_prob"], r1_actor_config("token-mean", loss_mode="bypass_mode"))
