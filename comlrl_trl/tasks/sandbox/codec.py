"""Plain data across the sandbox boundary: a strict tagged encoding of values, and length-prefixed JSON frames.

Only these exact types cross (subclasses do not): None, bool, int, float (nan and inf included), str, bytes,
and list, tuple, dict, set, frozenset of them, nested at most `MAX_DEPTH` deep, with at most `MAX_HASHED_ITEMS`
set elements and dict keys in all. Each value becomes a JSON list whose first element is a one-letter tag, e.g.
`(1, "a")` -> `["T", [["I", "1"], ["S", "a"]]]`. `decode` accepts nothing else, so whatever the untrusted side
writes, the trusted side gets back plain Python data or a `ValueError`, never an object with methods of the
sender's choosing. Decoding is bounded: replies of at most `MAX_REPLY_BYTES`, `MAX_DECODE_SECONDS` of work, and
sets and dicts whose keys do not collide in their hashes (a crafted set of equal hashes would take quadratic time
to build).

This module is shared by the trusted checker (`checker.py`) and the untrusted child (`child.py`, which
loads it by path), so it uses only the standard library and no package-relative imports.
"""

import collections
import json
import os
import time


MAX_DEPTH = 64  # nesting of containers
MAX_FRAME_BYTES = 4 * 1024 * 1024  # one message from the checker to the child, JSON-encoded
MAX_REPLY_BYTES = 1024 * 1024  # one message from the child to the checker (it decodes while holding the GIL)
MAX_DECODE_SECONDS = 0.25  # `decode` gives up (ValueError) after this long
MAX_HASHED_ITEMS = 5000  # set elements plus dict keys in one decoded value
MAX_EQUAL_HASHES = 32  # set elements or dict keys of one container that share a hash (crafted collisions)
_SEQUENCES = {list: "L", tuple: "T", set: "E", frozenset: "Z"}
_BUILD = {"L": list, "T": tuple, "E": set, "Z": frozenset}


def encode(value, depth: int = 0) -> list:
    """`value` as tagged JSON-able data; `TypeError` for any other type, `ValueError` when nested too deep."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None:
        return ["N"]
    if kind is bool:
        return ["B", value]
    if kind is int:
        return ["I", str(value)]  # str() refuses ints of more than 4300 digits
    if kind is float:
        return ["F", value.hex()]  # exact, and covers nan and inf
    if kind is str:
        return ["S", value]
    if kind is bytes:
        return ["Y", value.hex()]
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["D", [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in value.items()]]
    raise TypeError(
        f"a {kind.__name__} cannot cross the sandbox boundary (only None, bool, int, float, str, "
        "bytes, and lists, tuples, dicts, sets and frozensets of them)"
    )


def decode(data, max_seconds: float = MAX_DECODE_SECONDS):
    """The value `encode` produced; `ValueError` for anything malformed, or when decoding takes longer than
    `max_seconds` (a crafted value must not hold the decoding process for long)."""
    return _decode(data, 0, _Budget(max_seconds))


class _Budget:
    """What one `decode` may still spend: set elements and dict keys, and time (checked every 1024 values)."""

    def __init__(self, max_seconds: float):
        self.hashed_left, self.count = MAX_HASHED_ITEMS, 0
        self.deadline = time.monotonic() + max_seconds

    def tick(self) -> None:
        self.count += 1
        if not self.count & 1023 and time.monotonic() > self.deadline:
            raise ValueError("a value that takes too long to decode")


def _decode(data, depth: int, budget: _Budget):
    if depth > MAX_DEPTH or type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError("malformed value")
    budget.tick()
    tag, args = data[0], data[1:]
    try:
        if tag == "N" and not args:
            return None
        if len(args) != 1:
            raise ValueError("malformed value")
        payload, kind = args[0], type(args[0])
        if tag == "B" and kind is bool:
            return payload
        if tag == "I" and kind is str:
            return int(payload)
        if tag == "F" and kind is str:
            return float.fromhex(payload)
        if tag == "S" and kind is str:
            return payload
        if tag == "Y" and kind is str:
            return bytes.fromhex(payload)
        if tag in ("E", "Z", "D") and kind is list:  # colliding hashes make building these quadratic: bound them
            budget.hashed_left -= len(payload)
            if budget.hashed_left < 0:
                raise ValueError(f"more than {MAX_HASHED_ITEMS} set elements and dict keys in one value")
        if tag in ("L", "T") and kind is list:
            return _BUILD[tag](_decode(item, depth + 1, budget) for item in payload)
        if tag in ("E", "Z") and kind is list:
            items = [_decode(item, depth + 1, budget) for item in payload]
            _check_hashes(items)
            return _BUILD[tag](items)
        if tag == "D" and kind is list:
            pairs = [_decode_pair(pair, depth + 1, budget) for pair in payload]
            _check_hashes([key for key, _ in pairs])
            return dict(pairs)
    except (TypeError, OverflowError, RecursionError) as error:  # e.g. an unhashable set element or dict key
        raise ValueError(f"malformed value: {error}") from None
    raise ValueError(f"malformed value (tag {tag[:8]!r})")


def _decode_pair(pair, depth: int, budget: _Budget) -> tuple:
    if type(pair) is not list or len(pair) != 2:
        raise ValueError("malformed dict entry")
    return _decode(pair[0], depth, budget), _decode(pair[1], depth, budget)


def _check_hashes(keys: list) -> None:
    """`ValueError` when many keys share one hash: building the set or dict would take quadratic time.
    (`TypeError` for an unhashable key, as building it would.)"""
    if len(keys) > MAX_EQUAL_HASHES:
        counts = collections.Counter(hash(key) for key in keys)
        if max(counts.values()) > MAX_EQUAL_HASHES:
            raise ValueError(f"more than {MAX_EQUAL_HASHES} set elements or dict keys with one hash")


def frame(message: dict, limit: int = MAX_FRAME_BYTES) -> bytes:
    """One message as bytes: a 4-byte big-endian length, then the JSON text (`ValueError` above `limit` bytes)."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8", errors="surrogatepass")
    if len(body) > limit:
        raise ValueError(f"message of {len(body)} bytes exceeds the {limit}-byte limit")
    return len(body).to_bytes(4, "big") + body


def parse(body: bytes) -> dict:
    """The message in a frame's body; `ValueError` unless it is a JSON object."""
    try:
        message = json.loads(body.decode("utf-8", errors="surrogatepass"))
    except (ValueError, RecursionError) as error:
        raise ValueError(f"malformed message: {str(error)[:80]}") from None
    if type(message) is not dict:
        raise ValueError("malformed message: not an object")
    return message


def read_exact(fd: int, size: int) -> bytes:
    """Blocking read of exactly `size` bytes (the child's side); `EOFError` when the pipe closes first."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    """Blocking write of all of `data` (the child's side)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
