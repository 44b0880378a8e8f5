"""The data-only encoding of exchanges and check entries: values round-trip, untrusted bytes never run."""

from __future__ import annotations

import ast
import collections
import json
import pickle
import re
import threading
from pathlib import Path
from typing import NamedTuple

import optree
import pytest
import torch

import fshard
from fshard._api.dist import Piece, Report
from fshard._base.calls import call_name
from fshard._exec.collective import collective
from fshard._layout.layout import with_partial
from fshard.backends.torch_dist import _wire
from fshard.backends.torch_dist._wire import Unsendable, decode, encode

LAYOUT = fshard.Chunk(0, [0, 1]).layout((4, 3))
PIECE = Piece(LAYOUT.shards[0], torch.int32, "cpu", False, False, "torch.strided")


class Pair(NamedTuple):
    a: int
    b: int


# What fshard exchanges, one value per call site kind (grep `exchange(` in fshard/).
VALUES = {
    "scalars": (None, True, 3, -2.5, "text", 2**80),
    "from_local_tensor info": (1, (4, 3), torch.float32, False, "cpu"),
    "from_local_tensor props": (2, ("problem",), {(torch.bfloat16, True)}),
    "shard src info": (0, None, None, False, ("SpecError", "bad")),
    "from_local_shards report": Report(0, (4, 3), (PIECE,), ("x",)),
    "layout and meta": (LAYOUT, LAYOUT.shards[1], LAYOUT.shards[1].placement),
    "map_local outcome": (
        "ok",
        ((optree.tree_structure({"a": (1, [2, None]), "b": Pair(1, 2)}), [(torch.float16, {(0, 1): (2, 3)})]), {3}),
    ),
    "shard_map outcome": ("ok", ((optree.tree_structure(torch.max(torch.ones(2, 2), 0)), []), frozenset())),
    "checkpoint summary": (0, None, {"data/0.safetensors": {"rank": 0, "size": 12, "sha": ["ab"]}}),
    "misc": (torch.Size([2, 3]), torch.device("cpu"), 1 + 2j, b"\x00\xff", collections.OrderedDict(z=1, a=2)),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_exchanged_values_round_trip(name):
    value = VALUES[name]
    assert decode(encode(value)) == value


def test_layout_round_trip_keeps_partial():
    layout = with_partial(fshard.Replicated([0, 1]).layout((3,)), "sum")
    assert decode(encode(layout)) == layout


def test_layout_round_trip_keeps_which_copies_are_summands():
    mesh = fshard.Mesh((2, 2), axis_names=("dp", "tp"))
    layout = fshard.Partial(fshard.Named(mesh, (None,)), over="tp").layout((3,))
    back = decode(encode(layout))
    assert back == layout
    assert back.terms.tolist() == [0, 1, 0, 1]
    assert back != fshard.Partial(fshard.Named(mesh, (None,))).layout((3,))


def test_errors_travel_as_their_type_with_notes():
    err = fshard.SpecError("bad dim")
    err.add_note("(on rank 2)")
    got = decode(encode(err))
    assert type(got) is fshard.SpecError
    assert got.args == ("bad dim",)
    assert got.__notes__ == ["(on rank 2)"]
    key = decode(encode(KeyError("k")))
    assert type(key) is KeyError
    assert str(key) == "'k'"
    assert type(decode(encode(KeyboardInterrupt()))) is KeyboardInterrupt


def test_errors_of_other_types_travel_as_runtime_errors_naming_the_type():
    class Custom(ValueError):
        pass

    got = decode(encode(Custom("odd")))
    assert type(got) is RuntimeError
    assert got.args == ("Custom: odd",)


def test_encode_refuses_anything_but_data_naming_where_it_sits():
    with pytest.raises(fshard.SpecError, match=re.escape("Cannot exchange value[1]['fn'], a builtins.function")):
        encode((0, {"fn": lambda: 0}))
    with pytest.raises(fshard.SpecError, match=re.escape("Cannot exchange value, a torch.Tensor")):
        encode(torch.ones(2))


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_bytes_refused_from_a_peer_name_ranks_in_different_calls_and_from_the_store_do_not():
    """A peer's bytes that are not metadata usually mean it is in another call; check mode's entries are its own."""
    with pytest.raises(fshard.CollectiveMismatchError, match=r"ranks called different fshard functions") as peer:
        decode(b"\xff", "rank 1", peer=True)
    assert "check_collectives=True" in str(peer.value)
    with pytest.raises(fshard.CollectiveMismatchError) as store:
        decode(b"\xff", "the rendezvous store (key 'fshard/check/0')")
    assert "different fshard functions" not in str(store.value)
    assert "bind it to a private interface" in str(store.value)


def test_decode_refuses_a_pickle_and_never_runs_it(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(("reshard(...)", _Evil(marker)))
    with pytest.raises(fshard.CollectiveMismatchError, match=r"^Refused metadata from rank 3: UnicodeDecodeError"):
        decode(payload, "rank 3")
    payload = pickle.dumps(("reshard(...)", _Evil(marker)), protocol=0)  # protocol 0 is ASCII
    with pytest.raises(fshard.CollectiveMismatchError, match=r"^Refused metadata from a peer: JSONDecodeError"):
        decode(payload)
    assert not marker.exists()


CRAFTED = {
    "unknown tag": (["os.system", "touch /tmp/x"], "not an encoded value"),
    "a function by name": (["nt", "os", "system", "touch /tmp/x"], "no class os.system is loaded"),
    "a class that is not a named tuple": (["nt", "subprocess", "Popen", "touch /tmp/x"], "is not a named tuple"),
    "a module not imported": (["nt", "antigravity", "X"], "no class antigravity.X is loaded"),
    "an unknown record": (["record", "Popen", "ls"], "not an fshard record: 'Popen'"),
    "an exception outside the list": (["exc", "SystemError", ["x"], []], "not an allowed exception: 'SystemError'"),
    "an exception with an object argument": (["exc", "ValueError", [["l"]], []], "plain scalars"),
    "a dtype that is a function": (["dtype", "tensor"], "not a torch dtype: 'tensor'"),
    "a size of strings": (["size", "1"], "a size holds a non-int"),
    "a dict with an unhashable key": (["d", ["l", 1], 2], "unhashable type: 'list'"),
    "a tree whose leaves are data": (["tree", False, "", ["l", "secret"]], "leaves other than 0"),
    "a bad layout": (["layout", {"shape": [4], "shards": "x"}], "TypeError"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_decode_refuses_crafted_payloads(name):
    value, why = CRAFTED[name]
    with pytest.raises(fshard.CollectiveMismatchError, match=re.escape(why)):
        decode(json.dumps(value).encode(), "the store")


def test_decode_bounds_size_and_depth(monkeypatch):
    with pytest.raises(fshard.CollectiveMismatchError, match="nested deeper than 48 levels"):
        decode(json.dumps(encode_nested(60)).encode())
    with pytest.raises(fshard.CollectiveMismatchError, match="RecursionError"):
        decode(b"[" * 100_000 + b"]" * 100_000)
    monkeypatch.setattr(_wire, "MAX_BYTES", 100)
    with pytest.raises(fshard.CollectiveMismatchError, match="101 bytes, more than the 100 that metadata may take"):
        decode(b" " * 101)


def encode_nested(depth: int) -> list:
    value: list = ["l"]
    for _ in range(depth):
        value = ["l", value]
    return value


def test_unsendable_is_a_record():
    assert decode(encode(Unsendable("why"))) == Unsendable("why")


READ_PATHS = [
    "backends/torch_dist/_check.py",
    "backends/torch_dist/_exchange.py",
    "backends/torch_dist/_wire.py",
    "fshard/_exec/agree.py",
]


@pytest.mark.parametrize("path", READ_PATHS)
def test_no_pickle_in_what_reads_peers_or_the_store(path):
    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {"pickle", "cloudpickle", "marshal", "dill"} & imported


class _Recorder:
    """A backend of several processes that records, per thread, the checks a public call settles."""

    spans_processes, member = True, True

    def __init__(self) -> None:
        self.settled: list[tuple[str, str]] = []

    def settle(self, what: str, error: BaseException | None = None) -> None:
        self.settled.append((threading.current_thread().name, what))


def test_check_mode_calls_are_per_thread():
    """Two threads inside check-mode calls at once: each names its own call (the stack was process-wide)."""
    backend, barrier, seen = _Recorder(), threading.Barrier(2), {}

    @collective("op")
    def op(tag: str, backend: object) -> None:
        barrier.wait()  # both threads are inside their call here
        seen[tag] = call_name()
        barrier.wait()

    old = fshard.config(check_collectives=True)
    try:
        threads = [threading.Thread(target=op, args=(t,), kwargs={"backend": backend}, name=t) for t in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        fshard.config(check_collectives=old.check_collectives)
    assert seen == {"a": "op(tag='a')", "b": "op(tag='b')"}
    assert sorted(backend.settled) == [("a", "op(tag='a') returned"), ("b", "op(tag='b') returned")]


@pytest.mark.parametrize("posted", [True, False], ids=["posted-to-the-others", "not-posted"])
def test_an_interrupt_in_a_check_mode_call_settles_only_where_the_others_know_of_it(posted):
    """An interrupt that ``agree`` posted is settled like an error (the others settle too); a Ctrl-C
    anywhere else propagates at once, without a closing check that could wait ``check_timeout``."""
    backend = _Recorder()

    @collective("op")
    def op(backend: object) -> None:
        exc = KeyboardInterrupt()
        if posted:
            exc._fshard_posted = True
        raise exc

    old = fshard.config(check_collectives=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            op(backend=backend)
    finally:
        fshard.config(check_collectives=old.check_collectives)
    assert backend.settled == ([(threading.current_thread().name, "op() raised")] if posted else [])
