"""Lifecycle: which versions of which models are loaded, and how that changes.

``control`` owns the table of models (load, reload, unload, uploads committed only after
their load succeeds); ``on_demand`` loads a model a request names when the server allows
it; ``residency`` keeps loaded models within a memory budget (``memory`` measures them);
``rollout`` and ``promotion`` run canaries, golden-set checks and rollbacks; ``warmup``
runs a model's warm-up samples before it is ready. A version's number and files come from
the repository; everything here asks it, never the disk directly.
"""
