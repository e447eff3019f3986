"""Triton's sequence batcher (``sequence_batching``): stateful models.

Not implemented yet: a config that asks for it is refused at load, with the reason,
rather than served without its sequence behaviour (the control inputs would never reach
the model)."""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from ..protocol.errors import Unsupported


def check_supported(config: mc.ModelConfig) -> None:
    """Refuse, at load, every part of ``sequence_batching`` this server does not implement."""
    raise Unsupported(
        f"model '{config.name}': sequence_batching is not supported by this server yet; "
        f"remove 'sequence_batching' from the config to serve the model without sequences")
