"""Any Hugging Face causal LM as the policy, a value model on the same backbone, and token log-probs.

Alignment (docs/formulas.md#notation). For a sequence ``x_0 .. x_{T-1}`` the quantities of token
``t`` are about the state *before* it, ``s_t = x_{<t}``:

- ``token_logprobs(...).logp[:, t] = log pi(x_t | x_{<t})`` = log_softmax(logits[:, t-1] / temperature)[x_t];
- ``ValueModel(...)[:, t] = V(s_t)`` = head(hidden[:, t-1]).

Position 0 (and, in a left-padded row, the first real token) has no prefix: both are defined as 0
there, as are positions after right padding. Prompts are never empty, so an action token is
never at position 0 and that value is never used. The head's output at the *last* position,
V(s_{T}) (the state after the final token), is what ``truncation = bootstrap`` needs; get it with
``ValueModel.forward(..., shift=False)``, which returns the unshifted per-position outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

#: A map from raw float32 logits ``[..., V]`` to log-probs ``[..., V]`` (``-inf`` = excluded): the
#: sampler's transform (temperature, top-k, top-p), e.g. ``copc.rollout.engine.truncated_logprobs``.
LogProbTransform = Callable[[torch.Tensor], torch.Tensor]

#: The log-prob given to a token its distribution excludes (outside the top-k / top-p set): finite, so
#: that log-ratios stay defined (``-inf - -inf`` is NaN); any log-ratio against it clamps to -+20.
EXCLUDED_LOGPROB = -1.0e4

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_META_FILE = "value_head.json"


def load_policy(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local folder (or a hub name where the hub is reachable).

    Args:
        path: folder written by ``save_pretrained`` (the tiny model's included) or a hub name.
        dtype: parameter dtype (log-probs are computed in float32 whatever this is).
        device: where to put the model.
        gguf_file: name of a GGUF file inside ``path`` to load instead of safetensors (needs ``gguf``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode. A tokenizer without a pad token gets its EOS
        token as pad (batched generation pads on the left).
    """
    kwargs: dict[str, str] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load a causal LM from {path!r}: {err}. Pass a folder written by save_pretrained "
            "(e.g. the tiny model: copc.models.build_tiny_model(...).save_pretrained(dir)) or a hub name "
            "on a machine that can reach the hub."
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(device)  # type: ignore[arg-type]  # transformers' stub types .to's argument wrongly
    return model.eval(), tokenizer


def convert_gguf(folder: str | Path, gguf_file: str, out: str | Path) -> Path:
    """Load ``folder/gguf_file`` once (transformers de-quantizes it to float32) and save it to ``out`` as an
    ordinary ``save_pretrained`` folder with its tokenizer (and chat template), so later runs load fast.

    A GGUF-loaded model refuses ``save_pretrained`` (it is marked as quantized although its weights are
    plain float32 tensors), so the weights are moved into a model built from the same config.
    """
    model, tokenizer = load_policy(folder, gguf_file=gguf_file)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return _save_rebuilt(config, model.state_dict(), model, tokenizer, out, what=f"converting {gguf_file}")


def _save_rebuilt(config: object, weights: dict[str, torch.Tensor], model: PreTrainedModel,
                  tokenizer: PreTrainedTokenizerBase, out: str | Path, *, what: str) -> Path:
    """Build a float32 causal LM from ``config``, load ``weights`` (every key but tied ones must match) and
    save it with ``model``'s generation config and ``tokenizer`` to ``out``."""
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = rebuilt.load_state_dict(weights, strict=False)
    tied = set(getattr(rebuilt, "_tied_weights_keys", None) or ())
    if [k for k in result.missing_keys if k not in tied] or result.unexpected_keys:
        raise RuntimeError(f"{what}: weights do not match the config ({result})")
    rebuilt.generation_config = model.generation_config
    rebuilt.save_pretrained(Path(out))
    tokenizer.save_pretrained(Path(out))
    return Path(out)


def save_first_layers(folder: str | Path, layers: int, out: str | Path) -> Path:
    """Save the causal LM of ``folder`` cut to its first ``layers`` decoder layers (embeddings, those layers,
    final norm and head unchanged) to ``out`` with its tokenizer: a smaller critic backbone of the same
    tokenizer for ``model.critic=out`` (the value head reads the last kept layer's normed output).

    Works for models whose config counts layers in ``num_hidden_layers`` and names them ``layers.<i>.``
    (Llama, Qwen, Mistral, SmolLM, Gemma families); per-layer config lists (``layer_types``) are cut too.
    """
    model, tokenizer = load_policy(folder)
    config = model.config
    total = int(config.num_hidden_layers)
    if not 1 <= layers < total:
        raise ValueError(f"layers must be in [1, {total - 1}] for a model of {total} layers, got {layers}")
    config.num_hidden_layers = layers
    for key in ("layer_types",):
        value = getattr(config, key, None)
        if isinstance(value, list) and len(value) == total:
            setattr(config, key, value[:layers])
    dropped = [f"layers.{i}." for i in range(layers, total)]
    kept = {k: v for k, v in model.state_dict().items() if not any(d in k for d in dropped)}
    return _save_rebuilt(config, kept, model, tokenizer, out, what=f"cutting {folder} to {layers} layers")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding: ``cumsum(mask) - 1``, clamped at 0 on (left) pad positions.

    Args:
        attention_mask: ``[B, T]`` bool or int, True/1 on real tokens.

    Returns:
        ``[B, T] int64``; the first real token of every row has position 0, whichever side is padded.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _check_logprob_args(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
    transform: LogProbTransform | None
) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); use the sampler's temperature")
    if transform is not None and temperature != 1.0:
        raise ValueError("give the temperature to the transform (it maps raw logits), not to token_logprobs")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )


def _next_token_logits(model: PreTrainedModel, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T-1, V] float32``: the logits at positions 0..T-2, which predict tokens 1..T-1."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits[:, :-1].float()


def _finite(picked: torch.Tensor) -> torch.Tensor:
    """Excluded tokens (``-inf``) get :data:`EXCLUDED_LOGPROB`; no gradient reaches them."""
    return torch.where(torch.isfinite(picked), picked, EXCLUDED_LOGPROB)


class TokenLogProbs(NamedTuple):
    """:func:`token_logprobs`' result: ``[B, T] float32`` each, 0 where token t has no real predecessor."""

    logp: torch.Tensor
    """``log pi(x_t | x_{<t})`` under the sampler's transform."""
    entropy: torch.Tensor | None
    """``H(pi(. | x_{<t}))`` of the same distributions; None unless asked for (``entropy=True``)."""


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    transform: LogProbTransform | None = None,
    entropy: bool = False,
) -> TokenLogProbs:
    """log pi(x_t | x_{<t}) for every token, under the sampler's transform, in float32, and (``entropy``)
    the entropies of the same distributions from the same forward.

    Without ``transform``: ``logp[:, t] = (l_{t-1}[x_t] / tau) - logsumexp(l_{t-1} / tau)`` where
    ``l_{t-1}`` are the model's float32 logits at position t-1 and tau the temperature (the engine's
    behaviour log-prob when top-k = 0 and top-p = 1). With ``transform`` (the sampler's temperature,
    top-k and top-p, e.g. ``partial(truncated_logprobs, temperature=, top_k=, top_p=)``): ``logp[:, t] =
    transform(l_{t-1})[x_t]``, the truncated, renormalised distribution the sampler drew from; a token
    it excludes gets :data:`EXCLUDED_LOGPROB`. ``logp[:, 0] = 0``. Gradients flow (the kept set is
    piecewise constant in the weights, so the gradient is that of the truncated policy almost
    everywhere); wrap in ``torch.no_grad()`` for logp_old.

    ``entropy[:, t] = -sum_v p_v log p_v`` over the tokens the distribution keeps, for the distribution
    that predicts token t. Asking for it costs the full ``[B, T-1, V]`` log-prob tensor (and its
    backward); without it and without ``transform`` only the picked entries are formed. The log-probs
    are the same bit for bit either way.

    Args:
        model: a causal LM.
        input_ids: ``[B, T] int64``.
        attention_mask: ``[B, T]`` bool/int, True on real tokens (left or right padding both work).
        temperature: tau > 0, the same value the engine sampled with (1 when ``transform`` is given).
        transform: the sampler's logits -> log-probs map, or None (temperature only).
        entropy: also return the entropies.

    Returns:
        :class:`TokenLogProbs`; 0 on each row's first real token (no prefix) and on padding.
    """
    _check_logprob_args(input_ids, attention_mask, temperature, transform)
    logits_prev = _next_token_logits(model, input_ids, attention_mask)  # [B, T-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)
    if transform is None and not entropy:  # the picked entries only: no [B, T-1, V] log-prob tensor
        scaled = logits_prev / temperature
        picked = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        return TokenLogProbs(_shift_right(picked, attention_mask), None)
    if transform is None:
        scaled = logits_prev / temperature
        logprobs = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # [B, T-1, V]
    else:
        logprobs = transform(logits_prev)
    picked = _finite(logprobs.gather(-1, targets).squeeze(-1))
    if not entropy:
        return TokenLogProbs(_shift_right(picked, attention_mask), None)
    kept = torch.isfinite(logprobs)
    safe = torch.where(kept, logprobs, 0.0)  # 0 * -inf would be NaN, in the forward and the backward
    entropies = -torch.where(kept, safe.exp() * safe, 0.0).sum(dim=-1)
    return TokenLogProbs(_shift_right(picked, attention_mask), _shift_right(entropies, attention_mask))


def _shift_right(prev: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Place ``prev[:, t-1]`` at t; 0 where token t has no real predecessor (t = 0, first real token).

    Args:
        prev: ``[B, T-1]`` float32, quantities computed at positions 0..T-2.
        attention_mask: ``[B, T]``, True on real tokens.
    """
    mask = attention_mask.bool()
    has_prefix = mask[:, 1:] & mask[:, :-1]
    shifted = torch.where(has_prefix, prev, torch.zeros_like(prev))
    return torch.cat([prev.new_zeros(prev.shape[0], 1), shifted], dim=1)


def _base_model(policy: PreTrainedModel) -> PreTrainedModel:
    """The transformer under a causal LM's output layer (``policy.model`` for Llama/Qwen)."""
    base = getattr(policy, policy.base_model_prefix, None)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"{type(policy).__name__} has no base model at .{policy.base_model_prefix}; "
            "pass a causal LM built by AutoModelForCausalLM"
        )
    return base


class ValueModel(nn.Module):
    """Critic: the policy's backbone (no LM head) plus ``Linear(hidden, 1)``, values in float32.

    ``values[:, t] = V(s_t) = head(h[:, t-1])`` (state before token t), ``values[:, 0] = 0`` (module
    docstring). The head is float32 whatever the backbone dtype, initialised small (weights
    N(0, head_init_std^2), bias 0) so early value estimates are near 0 and do not swamp GAE.
    """

    def __init__(self, backbone: PreTrainedModel, *, head_init_std: float = 1e-3) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = int(backbone.config.hidden_size)
        device = next(backbone.parameters()).device
        self.head = nn.Linear(hidden, 1, dtype=torch.float32, device=device)
        nn.init.normal_(self.head.weight, std=head_init_std)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel, *, head_init_std: float = 1e-3) -> ValueModel:
        """A critic whose backbone is a deep copy of the policy's (weights shared at init, not after)."""
        import copy

        return cls(copy.deepcopy(_base_model(policy)), head_init_std=head_init_std)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, head_init_std: float = 1e-3
    ) -> ValueModel:
        """Load a critic saved by :meth:`save_pretrained`, or start one from any causal-LM checkpoint.

        If ``path`` has no ``value_head.safetensors`` (a policy checkpoint) the head is freshly
        initialised; the backbone weights are loaded either way.
        """
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        model = cls(backbone, head_init_std=head_init_std)
        head_path = Path(path) / VALUE_HEAD_FILE
        if head_path.exists():
            model.head.load_state_dict(load_file(str(head_path)))
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write the backbone with ``save_pretrained`` and the head as ``value_head.safetensors``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path)
        save_file({k: v.detach().contiguous() for k, v in self.head.state_dict().items()},
                  str(path / VALUE_HEAD_FILE))
        meta = {"hidden_size": self.head.in_features, "alignment": "values[:, t] = head(h[:, t-1])"}
        (path / VALUE_META_FILE).write_text(json.dumps(meta, indent=2))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, shift: bool = True
    ) -> torch.Tensor:
        """Values per token.

        Args:
            input_ids: ``[B, T] int64``.
            attention_mask: ``[B, T]`` bool/int, True on real tokens.
            shift: True (default): ``[:, t] = V(s_t)``, the state before token t, 0 on each row's
                first real token and on padding.
                False: ``[:, t] = head(h[:, t])``, the state after token t (the last real position gives
                the bootstrap value V(s_{T+1})).

        Returns:
            ``[B, T] float32``.
        """
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        raw = self.head(out.last_hidden_state.float()).squeeze(-1)  # [B, T]
        if not shift:
            return raw
        return _shift_right(raw[:, :-1], attention_mask)
