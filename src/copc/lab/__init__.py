"""copc.lab: exact bias/variance decomposition of the two-channel actor update on small token MDPs.

Everything is enumerated (``K**H`` sequences), so ``E[ĝ]``, ``Cov[ĝ]`` and the bias/variance split of
docs/formulas.md#two-channels are exact. A :class:`Correction` is a pair of production configs
(:class:`copc.channels.PolicyChannelConfig`, :class:`copc.channels.AdvantageChannelConfig`), and the
per-token weights and advantages come from the trainer's own channels. See docs/lab.md.
"""

from copc.lab.corrections import Correction
from copc.lab.exact import Critic, Decomposition, decompose
from copc.lab.mdp import TokenMDP, behaviour_at_kl, gradient_path, make_mdp, random_logits, true_gradient
from copc.lab.sweep import SweepConfig, run_sweep

__all__ = [
    "Correction",
    "Critic",
    "Decomposition",
    "SweepConfig",
    "TokenMDP",
    "behaviour_at_kl",
    "decompose",
    "gradient_path",
    "make_mdp",
    "random_logits",
    "run_sweep",
    "true_gradient",
]
