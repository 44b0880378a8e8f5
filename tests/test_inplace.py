"""Per-block functions cannot write into their input blocks: the write is refused before it runs.

``map_local`` and ``shard_map`` run their function under a dispatch-level check
(``fshard._exec.readonly``): an aten op that would write into an input block, or into a
view of one, raises ``SpecError`` naming the op, and the array keeps its values, bit for
bit. Writes into tensors the function made itself go through.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch.func import grad, vmap
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

import fshard
from fshard import SpecError

ROWS = fshard.Chunk(0, [0, 1])
X = torch.arange(12.0).reshape(4, 3) / 8 - 0.5  # exact sums and products: results compare bit for bit


def _array() -> fshard.ShardedArray:
    return fshard.shard(X.clone(), ROWS)


def _bits(a: fshard.ShardedArray) -> list[tuple[list[int], int]]:
    """Each addressable block's bytes and version counter: equal before and after means untouched."""
    return [(s.data.contiguous().view(torch.uint8).flatten().tolist(), s.data._version) for s in a.addressable_shards]


# Each write, the op the error names and the argument it writes into.
WRITES: list[tuple[str, Callable[[torch.Tensor], object], str, str]] = [
    ("mul_", lambda t: t.mul_(10), "aten::mul_.Tensor", "self"),
    ("add_ with alpha", lambda t: t.add_(torch.ones_like(t), alpha=2), "aten::add_.Tensor", "self"),
    ("copy_", lambda t: t.copy_(t * 3), "aten::copy_", "self"),
    ("setitem", lambda t: t.__setitem__(0, 1), "aten::fill_.Tensor", "self"),
    ("index_put_", lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(5.0)), "aten::index_put_", "self"),
    ("out=", lambda t: torch.add(t, 1, out=t), "aten::add.out", "out"),
    ("a view written", lambda t: t[:1].zero_(), "aten::zero_", "self"),
    ("a detached alias", lambda t: t.detach().sub_(1), "aten::sub_.Tensor", "self"),
    ("relu inplace", lambda t: torch.nn.functional.relu(t, inplace=True), "aten::relu_", "self"),
    ("a list of outputs", lambda t: torch._foreach_add_([t], 1.0), "aten::_foreach_add_.Scalar", "self"),
]


def _refused(what: str, op: str, name: str) -> str:
    return re.escape(f"{what} fn called {op}, which writes into its argument {name!r} in place")


@pytest.mark.parametrize(("write", "op", "name"), [w[1:] for w in WRITES], ids=[w[0] for w in WRITES])
def test_map_local_refuses_the_write_before_it_happens(write, op, name) -> None:
    a = _array()
    before = _bits(a)
    with pytest.raises(SpecError) as info:
        fshard.map_local(write, a)
    assert _bits(a) == before
    assert torch.equal(fshard.gather(a), X)
    assert re.match(_refused("map_local()", op, name), str(info.value))


@pytest.mark.parametrize(("write", "op", "name"), [w[1:] for w in WRITES], ids=[w[0] for w in WRITES])
def test_shard_map_refuses_the_write_before_it_happens(write, op, name) -> None:
    a = _array()
    before = _bits(a)
    with pytest.raises(SpecError) as info:
        fshard.shard_map(write, ROWS, ROWS)(a)
    assert _bits(a) == before
    assert re.match(_refused("shard_map()", op, name), str(info.value))


def test_a_tensor_argument_of_shard_map_is_not_written() -> None:
    """shard_map slices a plain tensor argument without copying: its blocks are its memory."""
    x = X.clone()
    with pytest.raises(SpecError, match=_refused("shard_map()", "aten::mul_.Tensor", "self")):
        fshard.shard_map(lambda t: t.mul_(10), ROWS, ROWS)(x)
    assert torch.equal(x.view(torch.int32), X.view(torch.int32))
    assert x._version == 0


def test_the_second_argument_and_a_refusal_message_that_names_the_fix() -> None:
    a, b = _array(), _array()
    before = _bits(b)
    with pytest.raises(SpecError) as info:
        fshard.map_local(lambda s, t: t.mul_(s), a, b)
    assert _bits(b) == before
    assert "the write was refused before it ran, so the input is unchanged" in str(info.value)
    assert "Return a new tensor instead (t * 10, not t.mul_(10)" in str(info.value)


def test_writes_into_tensors_fn_made_itself_go_through() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape)
        out.copy_(t)
        y = t * 2
        y.add_(1)
        y[0] = 0
        torch.mul(t, 3, out=out)
        return out + y

    a = _array()
    before = _bits(a)
    want = X * 3 + X * 2 + 1
    want[[0, 2]] = X[[0, 2]] * 3
    assert torch.equal(fshard.gather(fshard.map_local(fn, a)), want)
    assert torch.equal(fshard.gather(fshard.shard_map(fn, ROWS, ROWS)(a)), want)
    assert _bits(a) == before


def test_a_refused_write_leaves_autograd_working() -> None:
    x = X.clone().requires_grad_(True)
    a = fshard.shard(x, ROWS)
    with pytest.raises(SpecError, match=_refused("map_local()", "aten::mul_.Tensor", "self")):
        fshard.map_local(lambda t: t.mul_(10), a)
    fshard.gather(fshard.map_local(lambda t: t * t, a)).sum().backward()
    assert torch.equal(x.grad, 2 * X)


def _modes() -> list[str]:
    """The torch-function and torch-dispatch modes active here, by class name."""
    from torch.overrides import _get_current_function_mode_stack

    return [type(m).__name__ for m in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())]


class _Probe(torch.autograd.Function):
    """Identity that records the modes active in its forward (``forward_modes``) and its backward (``modes``)."""

    modes: list[list[str]] = []  # noqa: RUF012
    forward_modes: list[list[str]] = []  # noqa: RUF012

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        _Probe.forward_modes.append(_modes())
        return t.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        _Probe.modes.append(_modes())
        return g


def test_the_check_runs_in_the_forward_call_only() -> None:
    """The check stands behind a torch-function mode in the body and a custom Function's forward, not the backward."""
    x = X.clone().requires_grad_(True)
    a = fshard.shard(x, ROWS)
    seen: list[list[str]] = []

    def body(t: torch.Tensor) -> torch.Tensor:
        seen.append(_modes())
        return _Probe.apply(t) * 2

    _Probe.modes.clear()
    _Probe.forward_modes.clear()
    fshard.gather(fshard.map_local(body, a)).sum().backward()
    # The per-shard mode (each rank's closed-over tensors counted, the arguments recording a gradient) in front.
    assert seen == [["_PerShard", "_ReadOnly"], ["_PerShard", "_ReadOnly"]]
    assert _Probe.forward_modes == [["_PerShard", "_ReadOnly"], ["_PerShard", "_ReadOnly"]]
    assert _Probe.modes == [[], []]
    assert torch.equal(x.grad, torch.full_like(X, 2.0))
    assert _get_current_dispatch_mode_stack() == []


def test_under_vmap_and_grad() -> None:
    xs = torch.stack([X, 2 * X])

    def per_sample(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(lambda b: b.mul_(10), fshard.shard(t, ROWS)))

    with pytest.raises(SpecError, match=_refused("map_local()", "aten::mul_.Tensor", "self")):
        vmap(per_sample)(xs)
    assert torch.equal(xs, torch.stack([X, 2 * X]))
    assert xs._version == 0

    def loss(t: torch.Tensor) -> torch.Tensor:
        return fshard.gather(fshard.map_local(lambda b: b.add_(1) * b, fshard.shard(t, ROWS))).sum()

    x = X.clone()
    with pytest.raises(SpecError, match=_refused("map_local()", "aten::add_.Tensor", "self")):
        grad(loss)(x)
    assert torch.equal(x, X)
    assert x._version == 0
    fine = grad(lambda t: fshard.gather(fshard.map_local(lambda b: (b * 1).add_(1) * b, fshard.shard(t, ROWS))).sum())
    assert torch.equal(fine(x), 2 * X + 1)
    assert vmap(lambda t: fshard.gather(fshard.map_local(lambda b: b + 1, fshard.shard(t, ROWS))))(xs).shape == (
        2,
        4,
        3,
    )


def test_a_body_compiled_by_dynamo_is_checked_at_run_time() -> None:
    """The compiled code's ops run under the check (the eager backend runs them one by one)."""
    torch._dynamo.reset()
    try:
        body = torch.compile(lambda t: t.mul_(10), backend="eager")
        a = _array()
        before = _bits(a)
        with pytest.raises(SpecError, match=_refused("map_local()", "aten::mul_.Tensor", "self")):
            fshard.map_local(body, a)
        assert _bits(a) == before
    finally:
        torch._dynamo.reset()


def test_a_write_the_check_cannot_see_is_still_caught_after_it() -> None:
    """With the torch-function and dispatch modes switched off (as in an Inductor kernel), the version counter tells."""

    def hidden(t: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return t.mul_(10)

    a = _array()
    with pytest.raises(SpecError, match=re.escape("map_local() fn wrote into an input block in place")):
        fshard.map_local(hidden, a)
    assert torch.equal(fshard.gather(a), X * 10)  # the write happened: this check comes after it


# -- 4 Gloo processes ---------------------------------------------------------------------------


def _every_rank_refuses(spec: fshard.Chunk) -> tuple[str, str, bool]:
    a = fshard.shard(X.clone(), spec)
    before = _bits(a)
    try:
        fshard.map_local(lambda t: t.mul_(10), a)
    except SpecError as exc:
        error = (type(exc).__name__, str(exc).split(",", 1)[0])
    else:
        error = ("no error", "")
    return *error, _bits(a) == before and torch.equal(fshard.gather(a), X)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [0, 1, 2]], ids=["every rank holds a block", "rank 3 holds none"])
def test_every_rank_raises_and_keeps_its_blocks(dist_pool, ranks) -> None:
    got = dist_pool.run(_every_rank_refuses, fshard.Chunk(0, ranks), timeout=60)
    assert got == [("SpecError", "map_local() fn called aten::mul_.Tensor", True)] * 4


# -- behind the per-shard torch-function mode (across processes, gradients recorded) ------------

# Each write a data-parallel body might attempt into its weight block, and the op the error names.
_FIRST_ROW = torch.tensor([0])
# Each write into the rows block (no gradient: a weight's view from its tap would meet
# autograd's own refusal first), and the op the error names.
GATED_WRITES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "mul_": (lambda x: x.mul_(10), "aten::mul_.Tensor"),
    "out= of a call let through": (lambda x: torch.tanh(x, out=x), "aten::tanh.out"),
    "relu inplace": (lambda x: torch.nn.functional.relu(x, inplace=True), "aten::relu_"),
    "embedding max_norm": (
        lambda x: torch.nn.functional.embedding(_FIRST_ROW, x, max_norm=0.1),
        "aten::embedding_renorm_",
    ),
    "a view written": (lambda x: x.view(-1)[:2].zero_(), "aten::zero_"),
    "embedding max_norm=0": (  # a max_norm of zero renormalizes too: not let through
        lambda x: torch.nn.functional.embedding(_FIRST_ROW, x, max_norm=0.0),
        "aten::embedding_renorm_",
    ),
    "relu inplace by position": (lambda x: torch.nn.functional.relu(x, True), "aten::relu_"),
    "embedding max_norm by position": (
        lambda x: torch.nn.functional.embedding(_FIRST_ROW, x, None, 0.1),
        "aten::embedding_renorm_",
    ),
}


def _gated(name: str | None) -> tuple[str, bool, int]:
    """A write (``GATED_WRITES[name]``) refused, or none, where the per-shard mode runs in front of the check.

    Returns the error's first words, whether the rows block kept its values, and how many
    aten ops reached the dispatch-level check.
    """
    from fshard._exec import readonly

    write = None if name is None else GATED_WRITES[name][0]
    R = [0, 1, 2, 3]
    w0 = X[:3].clone()  # 3 x 3
    w = fshard.shard(w0.clone(), fshard.Replicated(R))
    w.addressable_data[0].requires_grad_()
    x0 = torch.ones(2, 3) * (torch.distributed.get_rank() + 1)
    x = fshard.from_local_tensor(x0.clone(), dim=0)
    checked = [0]
    dispatch = readonly._ReadOnly.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        checked[0] += 1
        return dispatch(self, func, types, args, kwargs)

    def body(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        if write is not None:
            write(xb)
        h = torch.nn.functional.linear(xb, wb).tanh()
        return torch.nn.functional.layer_norm(h, h.shape[-1:]).sum()[None]

    step = fshard.shard_map(
        body, in_specs=(fshard.Chunk(0, R), fshard.Replicated(R)), out_specs=fshard.Partial(fshard.Replicated(R))
    )
    readonly._ReadOnly.__torch_dispatch__ = counted
    try:
        fshard.gather(step(x, w)).backward()
        error = "no error"
    except SpecError as exc:
        error = str(exc).split(",", 1)[0]
    finally:
        readonly._ReadOnly.__torch_dispatch__ = dispatch
    return error, torch.equal(x.addressable_data[0], x0) and torch.equal(w.addressable_data[0].detach(), w0), checked[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(GATED_WRITES))
def test_writes_are_refused_behind_the_per_shard_mode(dist_pool, name) -> None:
    op = GATED_WRITES[name][1]
    for error, kept, checked in dist_pool.run(_gated, name, timeout=60):
        assert (error, kept) == (f"shard_map() fn called {op}", True)
        assert checked >= 1  # the call ran under the check (all its aten ops, up to the refused one)


@pytest.mark.multiprocess
def test_calls_that_write_nothing_skip_the_dispatch_level_check(dist_pool) -> None:
    """linear, tanh, layer_norm, sum, indexing and the tap's views: no aten op of theirs reaches the check."""
    assert dist_pool.run(_gated, None, timeout=60) == [("no error", True, 0)] * 4


@torch.jit.script
def _scripted_mul_(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2.0)


def _disabled_mul_(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return t.mul_(10)


# Writes that no torch-function mode sees: each must still meet the dispatch-level check.
UNSEEN_WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    "torch functions disabled": _disabled_mul_,
    "a storage's fill_": lambda t: t.untyped_storage().fill_(0),
    "a storage's copy_": lambda t: t.untyped_storage().copy_(torch.zeros(t.numel()).untyped_storage()),
    "set_": lambda t: t.set_(torch.zeros(t.shape)),
    "TorchScript": _scripted_mul_,
}


def _unseen(name: str, across: bool) -> tuple[bool, bool]:
    """``UNSEEN_WRITES[name]`` into an input block: whether it raised, and whether the block kept its values.

    Both together say that it was refused before it ran (a write caught after it leaves the block written).

    ``across``: in a data-parallel ``shard_map`` on the default group (gradients recorded: the
    per-shard mode in front of the check); else in a ``map_local`` on the local backend.
    """
    write = UNSEEN_WRITES[name]
    x0 = torch.ones(4, 3)
    if across:
        R = [0, 1, 2, 3]
        w = fshard.shard(torch.ones(3, 3), fshard.Replicated(R))
        w.addressable_data[0].requires_grad_()
        x = fshard.from_local_tensor(x0.clone(), dim=0)

        def body(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
            write(xb)
            return (xb @ wb).sum()[None]

        step = fshard.shard_map(
            body, in_specs=(fshard.Chunk(0, R), fshard.Replicated(R)), out_specs=fshard.Partial(fshard.Replicated(R))
        )
        call = lambda: step(x, w)  # noqa: E731
    else:
        x = fshard.shard(torch.cat([x0] * 2), ROWS)
        call = lambda: fshard.map_local(lambda t: (write(t), t * 1)[1], x)  # noqa: E731
    try:
        call()
        raised = False
    except SpecError:
        raised = True
    except RuntimeError as exc:  # TorchScript raises a RuntimeError of its own, without the SpecError's message
        raised = "TorchScript interpreter" in str(exc)
    return raised, all(torch.equal(t, x0) for t in x.addressable_data)


@pytest.mark.parametrize("name", list(UNSEEN_WRITES))
def test_writes_no_torch_function_mode_sees_are_refused_before_they_run(name) -> None:
    assert _unseen(name, across=False) == (True, True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(UNSEEN_WRITES))
def test_writes_the_per_shard_mode_does_not_see_are_refused_before_they_run(dist_pool, name) -> None:
    assert dist_pool.run(_unseen, name, True, timeout=60) == [(True, True)] * 4


def test_a_shard_map_inside_a_per_shard_body_is_refused_before_its_bodies_run() -> None:
    """An inner ``shard_map`` is refused; the outer call's blocks keep their values."""
    from fshard.backends.local import LocalBackend

    R = [0, 1, 2, 3]
    # Ranks 4-7 hold nothing: the outer map_local runs under the per-shard mode while gradients are recorded.
    o = fshard.shard(torch.arange(8.0).reshape(4, 2).requires_grad_(), ROWS, backend=LocalBackend(world_size=8))

    ones = fshard.shard(torch.ones(4, 2), fshard.Chunk(0, R))  # an array made outside, used inside

    def outer(ob: torch.Tensor) -> torch.Tensor:
        def inner(t: torch.Tensor) -> torch.Tensor:
            s = fshard.psum(t.sum(), "x")
            ob.detach().add_(1)  # the outer call's input block
            return s[None]

        fshard.shard_map(inner, in_specs=fshard.Chunk(0, R), out_specs=fshard.Chunk(0, R))(ones)
        return ob * 1

    with pytest.raises(
        SpecError, match=r"shard_map\(\) was called inside map_local\(\)'s fn, which runs once per placement"
    ):
        fshard.map_local(outer, o)
    assert torch.equal(torch.cat([t.detach() for t in o.addressable_data]), torch.arange(8.0).reshape(4, 2))


def test_the_calls_let_through_write_into_no_argument_by_their_schemas() -> None:
    """Every aten op named like a method or builtin that the check lets through has no written argument but ``out``.

    The Python functionals on the list (``F.layer_norm``, ``F.cross_entropy``, ...) call such builtins.
    """
    import types

    from fshard._exec import readonly

    aliases = {"__getitem__": "index", "__radd__": "add", "__rsub__": "rsub", "__rmul__": "mul", "__truediv__": "div",
               "__rtruediv__": "div", "__rmatmul__": "matmul", "view_as": "view", "reshape_as": "reshape",
               "expand_as": "expand", "type_as": "to", "float": "to", "layer_norm": "native_layer_norm"}  # fmt: skip
    builtins = [f.__name__ for f in readonly._PURE_FUNCTIONS if isinstance(f, types.BuiltinFunctionType)]
    assert {"linear", "gelu", "scaled_dot_product_attention", "cat", "embedding", "layer_norm"} <= set(builtins)
    checked = 0
    for name in [*readonly._PURE_METHODS, *builtins]:
        op = aliases.get(name, name.strip("_"))
        packet = getattr(torch.ops.aten, op, None)
        assert packet is not None or op in {"size", "dim", "numel"}, name  # sizes: no aten op, nothing to write
        for overload in packet.overloads() if packet is not None else ():
            schema = getattr(packet, overload)._schema
            written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            assert written in ([], ["out"]) or all(a.kwarg_only for a in schema.arguments if a.name in written), (
                name,
                overload,
                written,
            )
            checked += 1
    assert checked > 150


class _NoHashMeta(type(torch.Tensor)):
    __hash__ = None  # pyright: ignore[reportAssignmentType]  # a metaclass that makes its classes unhashable


class _NoHash(torch.Tensor, metaclass=_NoHashMeta):
    pass


def test_a_subclass_whose_type_cannot_be_hashed_runs_behind_the_check() -> None:
    """The pure-call test hashes the argument types; one it cannot hash is compared by equality instead."""
    from fshard._exec import readonly

    block = torch.ones(2)
    x = torch.ones(2).as_subclass(_NoHash)
    with readonly.read_only([block], "test"), readonly.front():
        y = x + 1
        with pytest.raises(SpecError, match="writes into its argument"):
            block.as_subclass(_NoHash).add_(1)  # a subclass's call meets the dispatch-level check
    assert type(y) is _NoHash
    assert torch.equal(y.as_subclass(torch.Tensor), torch.full((2,), 2.0))
    assert torch.equal(block, torch.ones(2))
    assert not readonly.pure(torch.Tensor.add, (_NoHash,), (x, 1), {})
    assert readonly.pure(torch.Tensor.add, (torch.nn.Parameter,), (x, 1), {})


def test_a_functional_that_writes_only_when_asked_is_pure_where_asked_not_to_by_position_or_name() -> None:
    """``nn.Embedding`` passes ``max_norm=None`` by position: such a call is let through, one asked to write is not."""
    from fshard._exec import readonly

    idx, w = torch.tensor([0]), torch.ones(2, 3)
    kinds = (torch.Tensor,)
    embedding, relu = torch.nn.functional.embedding, torch.nn.functional.relu
    assert readonly.pure(embedding, kinds, (idx, w, None, None, 2.0, False, False), {})
    assert readonly.pure(embedding, kinds, (idx, w), {"max_norm": None})
    assert not readonly.pure(embedding, kinds, (idx, w, None, 1.0, 2.0, False, False), {})
    assert not readonly.pure(embedding, kinds, (idx, w, None, 0.0), {})  # zero renormalizes too
    assert not readonly.pure(embedding, kinds, (idx, w), {"max_norm": 1.0})
    assert readonly.pure(relu, kinds, (w, False), {})
    assert not readonly.pure(relu, kinds, (w, True), {})
    assert not readonly.pure(relu, kinds, (w,), {"inplace": True})


def _under_inference_mode() -> tuple[list[list[float]], str]:
    """Per-block functions of arrays made under inference_mode (inference tensors keep no version counter)."""
    ranks = [0, 1, 2, 3] if torch.distributed.is_initialized() else [0, 1]
    rows = fshard.Chunk(0, ranks)
    twice = fshard.shard_map(lambda b: 2 * b, in_specs=rows, out_specs=rows)
    summed = fshard.shard_map(
        lambda b: fshard.psum(b.sum(), "x")[None], rows, fshard.Replicated(ranks), check_vma=False
    )
    with torch.inference_mode():
        a = fshard.shard(torch.arange(8.0), rows)
        values = [fshard.gather(y).tolist() for y in (fshard.map_local(torch.sin, a), a * 2, twice(a), summed(a))]
        try:
            fshard.map_local(lambda t: t.add_(1), a)
            refused = "no error"
        except SpecError as e:
            refused = str(e).split(",")[0]
        values.append(fshard.gather(a).tolist())
    return values, refused


def _expected_under_inference_mode() -> list[list[float]]:
    x = torch.arange(8.0)
    return [x.sin().tolist(), (x * 2).tolist(), (x * 2).tolist(), [28.0], x.tolist()]


def test_per_block_functions_run_under_inference_mode_and_still_refuse_writes() -> None:
    values, refused = _under_inference_mode()
    assert values == _expected_under_inference_mode()
    assert refused == "map_local() fn called aten::add_.Tensor"


@pytest.mark.multiprocess
def test_per_block_functions_run_under_inference_mode_on_every_rank(dist_pool) -> None:
    for values, refused in dist_pool.run(_under_inference_mode, timeout=60):
        assert values == _expected_under_inference_mode()
        assert refused == "map_local() fn called aten::add_.Tensor"


AUTOGRAD_WRITES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "requires_grad_": (lambda t: t.requires_grad_(), "requires_grad_()"),
    "requires_grad =": (lambda t: setattr(t, "requires_grad", True), "the setter of .requires_grad"),
    "data =": (lambda t: setattr(t, "data", torch.zeros_like(t)), "the setter of .data"),
}


def _autograd_write(name: str, backend=None) -> tuple[str, bool, bool]:
    """The error (its first clause), whether the blocks kept their values and whether none requires grad."""
    write = AUTOGRAD_WRITES[name][0]
    kw = {} if backend is None else {"backend": backend}
    ranks = [0, 1] if backend is None else backend.ranks
    full = torch.arange(8.0).reshape(4, 2)
    a = fshard.shard(full, fshard.Chunk(0, ranks), **kw)
    before = [t.clone() for t in a.addressable_data]

    def fn(t: torch.Tensor) -> torch.Tensor:
        write(t)
        return t * 2

    try:
        fshard.shard_map(fn, in_specs=fshard.Chunk(0, ranks), out_specs=fshard.Chunk(0, ranks))(a)
        error = "no error"
    except SpecError as exc:
        error = str(exc).split(" on an input block", 1)[0]
    kept = all(torch.equal(t, b) for t, b in zip(a.addressable_data, before, strict=True))
    return error, kept, not any(t.requires_grad for t in a.addressable_data)


@pytest.mark.parametrize("name", list(AUTOGRAD_WRITES))
def test_a_change_of_an_input_blocks_autograd_facts_is_refused(name) -> None:
    """requires_grad_() and the setters run no aten op, so the torch-function mode refuses them itself."""
    assert _autograd_write(name) == (f"shard_map() fn called {AUTOGRAD_WRITES[name][1]}", True, True)
    ones = fshard.shard(torch.ones(4), fshard.Chunk(0, [0, 1]))
    out = fshard.map_local(lambda t: t.detach().requires_grad_() * 1, ones)
    assert out.requires_grad  # a tensor fn made itself: fine


def _autograd_write_on_rank(name: str) -> tuple[str, bool, bool]:
    from fshard.backends.torch_dist import TorchDistBackend

    return _autograd_write(name, TorchDistBackend())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(AUTOGRAD_WRITES))
def test_a_change_of_an_input_blocks_autograd_facts_is_refused_on_every_rank(dist_pool, name) -> None:
    for got in dist_pool.run(_autograd_write_on_rank, name, timeout=60):
        assert got == (f"shard_map() fn called {AUTOGRAD_WRITES[name][1]}", True, True)


def _autograd_write_to_a_tapped_block(name: str) -> str:
    """The same change of a replicated weight's block that requires grad (its uses go through a tap's view)."""
    from fshard.backends.torch_dist import TorchDistBackend

    write = AUTOGRAD_WRITES[name][0]
    ranks = TorchDistBackend().ranks
    rep = fshard.Replicated(ranks)
    w = fshard.shard(torch.ones(2, 2), rep)
    for t in w.addressable_data:
        t.requires_grad_()
    x = fshard.from_local_tensor(torch.ones(1, 2), dim=0)

    def body(xb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
        write(wb)
        return (xb @ wb).sum()[None]

    try:
        fshard.shard_map(body, in_specs=(fshard.Chunk(0, ranks), rep), out_specs=fshard.Partial(rep))(x, w)
    except SpecError as exc:
        return str(exc).split(" on an input block", 1)[0]
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(AUTOGRAD_WRITES))
def test_a_change_of_a_tapped_blocks_autograd_facts_is_refused_on_every_rank(dist_pool, name) -> None:
    """The per-shard mode puts a view in the block's place first: the change is refused by the block it stands for."""
    want = f"shard_map() fn called {AUTOGRAD_WRITES[name][1]}"
    assert dist_pool.run(_autograd_write_to_a_tapped_block, name, timeout=60) == [want] * 4
