"""Why the gRPC port keeps its own HTTP/2 (frontends/h2_connection.py under grpc_calls.py) rather than build on the ``h2``
package (python-hyper's state machine, which grpclib and hypercorn use): the server-side CPU of
one unary gRPC call (1 KiB in, 1 KiB out) on one connection, ours against h2's H2Connection
driving the same handler. Both create one task per call and write once per loop iteration; the
client (h2 too) is not timed. h2 is not a dependency of the project:

    .venv/bin/pip install --target /tmp/h2lib h2
    PYTHONPATH=/tmp/h2lib .venv/bin/python benchmarks/h2_cost.py
"""
import asyncio
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jupyter_triton.frontends import grpc_calls, grpc_server  # noqa: E402

try:
    import h2.config
    import h2.connection
    import h2.events
except ImportError:
    sys.exit(__doc__)

N = 3000
PAYLOAD = bytes(1024)
PATH = "/inference.GRPCInferenceService/ModelInfer"
HEAD = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
        ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "grpc-python")]
MSG = b"\x00" + len(PAYLOAD).to_bytes(4, "big") + PAYLOAD

async def handler(request, context):
    return request

class Transport:
    def __init__(self): self.out = []
    def write(self, data): self.out.append(bytes(data))
    def is_closing(self): return False
    def get_write_buffer_size(self): return 0
    def get_extra_info(self, *a, **k): return None
    def pause_reading(self): pass
    def resume_reading(self): pass
    def close(self): pass
    def set_write_buffer_limits(self, *a, **k): pass
    def take(self):
        data, self.out = b"".join(self.out), []
        return data

def client():
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    c.initiate_connection()
    return c

def call_bytes(c):
    sid = c.get_next_available_stream_id()
    c.send_headers(sid, HEAD)
    c.send_data(sid, MSG, end_stream=True)
    return c.data_to_send()

async def spin():
    for _ in range(3):
        await asyncio.sleep(0)

async def ours():
    handlers = {"ModelInfer": grpc.unary_unary_rpc_method_handler(handler)}
    server = grpc_server.H2GrpcServer({"inference.GRPCInferenceService": handlers}, 1 << 26, 1024)
    conn = grpc_calls.GrpcConnection(server)
    t = Transport(); conn.connection_made(t)
    c = client(); conn.data_received(c.data_to_send()); await spin(); c.receive_data(t.take())
    spent = 0.0
    for _ in range(N):
        data = call_bytes(c)
        t0 = time.thread_time(); conn.data_received(data); await spin(); spent += time.thread_time() - t0
        events = c.receive_data(t.take())
        for e in events:
            if isinstance(e, h2.events.DataReceived):
                c.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        assert any(isinstance(e, h2.events.StreamEnded) for e in events), events
    conn.connection_lost(None)
    return spent / N

async def h2_server():
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    t = Transport()
    bodies = {}
    async def unary(sid, raw):
        response = await handler(raw[5:], None)
        conn.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        conn.send_data(sid, b"\x00" + len(response).to_bytes(4, "big") + response)
        conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)
        t.write(conn.data_to_send())
    def feed(data):
        for e in conn.receive_data(data):
            if isinstance(e, h2.events.RequestReceived):
                bodies[e.stream_id] = bytearray()
            elif isinstance(e, h2.events.DataReceived):
                bodies[e.stream_id] += e.data
                conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            elif isinstance(e, h2.events.StreamEnded):
                asyncio.get_running_loop().create_task(unary(e.stream_id, bytes(bodies.pop(e.stream_id))))
        t.write(conn.data_to_send())
    c = client(); feed(c.data_to_send()); await spin(); c.receive_data(t.take())
    spent = 0.0
    for _ in range(N):
        data = call_bytes(c)
        t0 = time.thread_time(); feed(data); await spin(); spent += time.thread_time() - t0
        events = c.receive_data(t.take())
        for e in events:
            if isinstance(e, h2.events.DataReceived):
                c.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        assert any(isinstance(e, h2.events.StreamEnded) for e in events), events
    return spent / N

results = {"ours (grpc_calls)": [], "h2 4.x": []}
for _ in range(3):
    results["ours (grpc_calls)"].append(asyncio.run(ours()))
    results["h2 4.x"].append(asyncio.run(h2_server()))
for k, v in results.items():
    print(f"{k:16s} server CPU per unary call: " + " / ".join(f"{x * 1e6:.1f}" for x in v) + " us (3 runs of %d calls)" % N)
