"""Batching: how requests become executions.

A request enters a scheduler (``scheduler``: direct or one queue; ``batcher``: Triton's
dynamic batcher with priorities, preferred sizes and queue policies), waits as a
``pending`` entry, and runs on an instance (``instances``: threads, on-loop executions,
the rate limiter's resources). Time comes from ``clock`` and ``timer`` (precise sleeps,
``busy_poll`` for microsecond delays), so ``simulation`` runs the same batcher on a
virtual clock. Nothing here loads a model or knows a wire format: the room below is the
backend, the room above the model version (``engine.model``).
"""
