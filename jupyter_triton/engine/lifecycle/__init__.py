"""Lifecycle: which versions of which models are loaded, and how that changes.

``table`` is the model table (per name: the versions served and staged, their states, the
lock every change of the name runs under), the one place that state lives; ``control``
owns it and the two rooms beside it, and does the loads, reloads, unloads and polls
(uploads committed only after their load succeeds); ``on_demand`` loads a model a request
names when the server allows it and evicts what ``residency`` chooses to keep loaded
models within a memory budget (``memory`` measures them); ``rollout`` and ``promotion``
run canaries, golden-set checks and rollbacks; ``warmup`` runs a model's warm-up samples
before it is ready. Each asks the table through its methods and a version through its
public ones. A version's number and files come from the repository; everything here asks
it, never the disk directly.

It may import every other room of the engine (it builds and tears down what they serve),
the repository, config and the backends' registry; never a frontend.
"""
