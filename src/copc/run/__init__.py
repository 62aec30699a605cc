"""The application layer: the run config, building a run, ``copc train``, ``copc eval`` and the warm start."""
