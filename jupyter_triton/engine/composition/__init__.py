"""Composition: requests that involve more than one execution of one model.

``ensemble`` runs a config's ensemble steps as a graph, ``bls`` lets a python model call
other models (bounded in depth and in flight), ``streaming`` carries a decoupled model's
many responses to one request, and ``sequence`` is Triton's sequence batcher (correlation
ids, control inputs, implicit state). Each sits on the batching room and asks the engine
for the models it calls.

It may import the batching room (the scheduler protocol, the instances), observation and
the protocol's types and errors; never a backend, the repository or a frontend.
"""
