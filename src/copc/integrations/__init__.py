"""Bridges from copc's channels into other RL frameworks.

Each module here imports its framework and is loaded only by that framework (never by ``import copc``):
:mod:`copc.integrations.verl` is verl's ``verl.plugins`` entry point (``pip install copc[verl]``).
"""
