"""Test-wide settings: one torch thread per process (the CI machine has ~1.3 cores of real parallelism)."""

import torch

torch.set_num_threads(1)
