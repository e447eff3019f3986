"""The JSON path's scan for integers past 64 bits (protocol/json_tensors.py
``may_hold_big_integer``): a document with one is parsed by json (orjson would read it as
a float); the scan says so exactly when a run of 20 or more digits stands between two
delimiters, or one of 19 or more after a minus sign (below -2**63), not after a point or an
exponent's e, nor before one."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from jupyter_triton.protocol.errors import InvalidArgument
from jupyter_triton.protocol.http_codec import decode_infer_request
from jupyter_triton.protocol.json_tensors import may_hold_big_integer

# The rule, said as a regular expression (too slow for the request path: 10x the scan).
_RULE = re.compile(rb"((?<![0-9.eE])[0-9]{20,}|-[0-9]{19,})(?![0-9.eE])")

_PIECES = [b"1", b"12", b"-", b"+", b".", b"e", b"E", b",", b" ", b"[", b"]", b'"', b"x",
           b"0" * 19, b"9" * 19, b"9" * 20, b"7" * 21, b"12345678901234567890", b"1" * 40, b"0.", b"e+"]


def test_the_scan_follows_the_rule_on_many_random_documents() -> None:
    rng = random.Random(18)
    found = 0
    for _ in range(20000):
        doc = b"".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12)))
        assert may_hold_big_integer(doc) == bool(_RULE.search(doc)), doc
        found += bool(_RULE.search(doc))
    assert 1000 < found < 19000         # both answers were asked many times


@pytest.mark.parametrize("doc, big", [
    (b"[18446744073709551616]", True), (b"[-18446744073709551616]", True),
    (b"[1844674407370955161]", False), (b"[4.4e20, 440059843361160300000.0]", False),
    (b"[0.000000000000000000000001]", False), (b"[1e123456789012345678901]", False),
    (b'{"id": "12345678901234567890"}', True), (b"12345678901234567890", True),
    (b"[1.5, 1234567890123456789012e3]", False), (b"[1.0, 12345678901234567890]", True),
    (b"[-9223372036854775809]", True), (b"[-922337203685477580]", False),
    (b"[-1234567890123456789.5]", False),
])
def test_documents_with_and_without_an_integer_past_64_bits(doc, big) -> None:
    assert may_hold_big_integer(doc) is big


def test_a_json_request_with_a_big_integer_is_refused_in_its_words_and_floats_pass() -> None:
    body = b'{"inputs":[{"name":"X","datatype":"INT64","shape":[2],"data":[1,18446744073709551616]}]}'
    # (read by orjson, the value would be a float: "element 1 is a number")
    with pytest.raises(InvalidArgument, match=r"element 1 is an integer \(18446744073709551616\)"):
        decode_infer_request(body, None, "m", "")
    # below -2**63 (19 digits): orjson would read a float that casts to -2**63 unseen
    body = b'{"inputs":[{"name":"X","datatype":"INT64","shape":[2],"data":[1,-9223372036854775809]}]}'
    with pytest.raises(InvalidArgument, match=r"element 1 is an integer \(-9223372036854775809\)"):
        decode_infer_request(body, None, "m", "")
    values = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    body = ('{"inputs":[{"name":"X","datatype":"FP32","shape":[1,256],"data":[%s]}]}'
            % ",".join(repr(float(v)) for v in values)).encode()
    request = decode_infer_request(body, None, "m", "")
    np.testing.assert_array_equal(request.inputs[0].data, values.reshape(1, 256))
