"""Pure tensor maths of copc: estimators, ratios, masks and losses (torch only). The package's facade.

Every function takes ``[B, T]`` tensors (``B`` sequences, ``T`` tokens) and a bool ``action_mask``
(True on tokens the policy sampled), keyword-only scalars (named tuples of scalars where several
travel together: :class:`ClipSpec`, :class:`AggSpec`), and returns tensors or named tuples. The
formulas as implemented are in docs/algorithms.md. Each name lives in one module:

- :mod:`copc.ops.masked`: masked reductions, normalisation, the one loss aggregator;
- :mod:`copc.ops.importance`: ratios, clips, masks, ESS and KL diagnostics;
- :mod:`copc.ops.scans`: the shared reverse-scan kernels (only ``discounted_reverse_cumsum`` here);
- :mod:`copc.ops.advantages`: GAE, V-trace, group baselines; :mod:`copc.ops.corrected_advantages`:
  COPC's ``clipped_td`` and BRACE;
- :mod:`copc.ops.policy_losses`: the one PPO formula, PPO (also bypass PPO), PG;
  :mod:`copc.ops.corrected_policy_losses`: decoupled (and TIS), COPC (and IcePop), SAO's DIS;
- :mod:`copc.ops.value_losses`: critic losses and the explained variance;
- :mod:`copc.ops.chunks`: turn-level advantages from values at turn boundaries (the Monte-Carlo
  oracle's) and an estimate's errors against them.
"""

# Each submodule's ``__all__`` is the one list of its public names: the star imports bind exactly those
# names here and the package's ``__all__`` is their concatenation (the ``+= submodule.__all__`` form that
# mypy and pyright read as re-exports). ``scans`` is the exception the docstring names.
from copc.ops import (
    advantages,
    chunks,
    corrected_advantages,
    corrected_policy_losses,
    importance,
    masked,
    policy_losses,
    value_losses,
)
from copc.ops.advantages import *
from copc.ops.chunks import *
from copc.ops.corrected_advantages import *
from copc.ops.corrected_policy_losses import *
from copc.ops.importance import *
from copc.ops.masked import *
from copc.ops.policy_losses import *
from copc.ops.scans import discounted_reverse_cumsum
from copc.ops.value_losses import *

__all__ = ["discounted_reverse_cumsum"]
__all__ += advantages.__all__
__all__ += chunks.__all__
__all__ += corrected_advantages.__all__
__all__ += corrected_policy_losses.__all__
__all__ += importance.__all__
__all__ += masked.__all__
__all__ += policy_losses.__all__
__all__ += value_losses.__all__
