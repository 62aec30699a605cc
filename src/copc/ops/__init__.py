"""Pure tensor maths of copc: estimators, ratios, losses (torch only; see docs/algorithms.md)."""
